"""Online INT8 on vllm-ascend: load modes, in-place reload, bucket safety, transactions, TP=2.

Real vLLM 0.11.0 + vllm-ascend 0.11.0 code on CPU (emulated torch_npu), tiny Qwen2 with q/k/v
bias, GQA and non-square projections. Set NPU_FLASHRL_VLLM_ASCEND_SRC to run against another
vllm-ascend source tree (e.g. v0.10.1rc1 with vllm 0.10.1 installed).
"""
import os
import random
import tempfile

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import assert_same_state, state
from npu_flashrl.sim.tiny_models import build_tiny_qwen2

from helpers import FUSED, build, fresh_states, hf_weights

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line

# Relative error of an INT8 linear (per-channel int8 weights, per-token int8 activations) against
# its bf16 layer: each operand carries <= 0.5/127 relative rounding per element; over a K-long dot
# product of random signs the errors average out to ~0.5-1% of the output norm. 3% leaves room for
# the bf16 scale storage and bf16 output rounding, and is far below the ~100% of a broken layer.
LINEAR_RTOL = 0.03

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")



@pytest.fixture(scope="module")
def ckpts():
    root = tempfile.mkdtemp(prefix="npu_flashrl_reload_")
    dirs, models = [], []
    for seed in range(4):
        d = os.path.join(root, f"w{seed}")
        models.append(build_tiny_qwen2(d, seed=seed))
        dirs.append(d)
    return dirs, models


def ref_fused(hf, layer, names):
    """Reference per-channel INT8 of the HF projections `names` of decoder layer `layer`."""
    mods = hf.model.layers[layer]
    qs, ss = [], []
    for n in names:
        sub = mods.self_attn if n in ("q_proj", "k_proj", "v_proj", "o_proj") else mods.mlp
        q, s = kernels.quantize_weight_per_channel(getattr(sub, n).weight.detach(), torch.bfloat16)
        qs.append(q)
        ss.append(s)
    return torch.cat(qs), torch.cat(ss)


def check_against_reference(model, hf):
    for i in range(hf.config.num_hidden_layers):
        for path, names in FUSED.items():
            layer = model.get_submodule(f"model.layers.{i}.{path}")
            q, s = ref_fused(hf, i, names)
            assert torch.equal(layer.weight.data, q.t()), f"layer {i} {path} int8 weight"
            torch.testing.assert_close(layer.weight_scale.data.float(), s, rtol=4e-3, atol=0)
            assert torch.equal(layer.weight_scale_fp32, layer.weight_scale.data.float())


def linear_outputs_close(model, hf):
    torch.manual_seed(0)
    for i in range(hf.config.num_hidden_layers):
        for path, names in FUSED.items():
            layer = model.get_submodule(f"model.layers.{i}.{path}")
            mods = hf.model.layers[i]
            subs = [getattr(mods.self_attn if n in PROJ[:4] else mods.mlp, n) for n in names]
            w = torch.cat([m.weight.detach().float() for m in subs])
            b = None
            if subs[0].bias is not None:
                b = torch.cat([m.bias.detach().float() for m in subs])
            x = torch.randn(5, w.shape[1]).to(torch.bfloat16)
            ref = x.float() @ w.t() + (b if b is not None else 0)
            out, _ = layer(x)
            err = (out.float() - ref).norm() / ref.norm()
            assert err < LINEAR_RTOL, f"layer {i} {path}: relative error {err:.4f}"


# --------------------------------------------------------------------------- load modes

def test_profile_free_cold_load_matches_reference(va, ckpts):
    dirs, models = ckpts
    with build(va, dirs[0]) as v:
        check_against_reference(v.model, models[0])
        linear_outputs_close(v.model, models[0])
        # non-quantized parameters load exactly
        p = dict(v.model.named_parameters())
        assert torch.equal(p["model.embed_tokens.weight"], models[0].model.embed_tokens.weight)
        assert torch.equal(p["lm_head.weight"], models[0].lm_head.weight)
        assert p["lm_head.weight"].dtype == torch.bfloat16


def test_three_syncs_equal_fresh_load_and_keep_pointers(va, ckpts):
    dirs, models = ckpts
    fresh = fresh_states(va, dirs, (1, 2, 3))
    with build(va, dirs[0]) as v:
        m = v.model
        assert {t.scheme.key for t in m._npu_flashrl_loader.targets.values()} == {("W8A8_DYNAMIC", "linear")}
        ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
        from npu_flashrl.kernels import reference

        fmt = reference.get_npu_format(m.model.layers[0].self_attn.qkv_proj.weight)
        for k in (1, 2, 3):
            m.load_weights(hf_weights(models[k]))
            va.end_weight_sync(m)
            assert_same_state(state(m), fresh[k])
            check_against_reference(m, models[k])
            assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
        # the NZ format survives the in-place writes
        assert reference.get_npu_format(m.model.layers[0].self_attn.qkv_proj.weight) == fmt
        linear_outputs_close(m, models[3])


def test_random_bucket_splits_and_orders_are_identical(va, ckpts):
    dirs, models = ckpts
    with build(va, dirs[0]) as v:
        v.model.load_weights(hf_weights(models[1]))
        va.end_weight_sync(v.model)
        want = state(v.model)
    rng = random.Random(0)
    for trial in range(3):
        with build(va, dirs[0]) as v:
            w = hf_weights(models[1])
            rng.shuffle(w)
            cuts = sorted(rng.sample(range(1, len(w)), 4))
            buckets = [w[a:b] for a, b in zip([0] + cuts, cuts + [len(w)])]
            for bucket in buckets:
                # generators too: verl streams buckets
                v.model.load_weights(iter(bucket) if trial % 2 else bucket)
            va.end_weight_sync(v.model)
            assert_same_state(state(v.model), want)


def test_missing_shard_is_reported_and_layer_keeps_previous_weights(va, ckpts):
    dirs, models = ckpts
    with build(va, dirs[0]) as v:
        before = state(v.model)
        w = [(n, t) for n, t in hf_weights(models[1]) if n != "model.layers.1.self_attn.v_proj.weight"]
        v.model.load_weights(w)
        assert "model.layers.1.self_attn.qkv_proj" in v.model._npu_flashrl_loader.pending()
        with pytest.raises(va.WeightSyncError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
            va.end_weight_sync(v.model)
        after = state(v.model)
        assert torch.equal(after["model.layers.1.self_attn.qkv_proj.weight"],
                           before["model.layers.1.self_attn.qkv_proj.weight"])
        assert not torch.equal(after["model.layers.0.self_attn.qkv_proj.weight"],
                               before["model.layers.0.self_attn.qkv_proj.weight"])
        # the next sync starts clean
        v.model.load_weights(hf_weights(models[2]))
        assert va.end_weight_sync(v.model) == []
        check_against_reference(v.model, models[2])


def _corrupt(weights, name, fn):
    return [(n, fn(t) if n == name else t) for n, t in weights]


@pytest.mark.parametrize("case", ["nan", "inf_bias", "shape", "unknown", "int_dtype"])
def test_bad_tensor_raises_naming_it_and_previous_weights_intact(va, ckpts, case):
    dirs, models = ckpts
    good = hf_weights(models[1])
    target = "model.layers.1.mlp.up_proj.weight"
    if case == "nan":
        bad = _corrupt(good, target, lambda t: t.index_put((torch.tensor([3]), torch.tensor([5])),
                                                           torch.tensor(float("nan"), dtype=t.dtype)))
        match = target + ".*NaN"
    elif case == "inf_bias":
        target = "model.layers.0.self_attn.k_proj.bias"
        bad = _corrupt(good, target, lambda t: t.fill_(float("inf")))
        match = target + ".*NaN or Inf"
    elif case == "shape":
        bad = _corrupt(good, target, lambda t: torch.cat([t, t[:1]]))
        match = target + ".*expected shape"
    elif case == "unknown":
        target = "model.layers.9.mlp.up_proj.weight"
        bad = good + [(target, torch.zeros(3, 3, dtype=torch.bfloat16))]
        match = r"model\.layers\.9"
    else:
        bad = _corrupt(good, target, lambda t: t.to(torch.int32))
        match = target + ".*floating-point"
    with build(va, dirs[0]) as v:
        before = state(v.model)
        with pytest.raises(va.WeightSyncError, match=match):
            v.model.load_weights(bad)
        assert_same_state(state(v.model), before)
        assert v.model._npu_flashrl_loader.pending() == {}
        # streamed (generator) input: no staging is left behind; a refusal checked as the item
        # comes leaves the failing layer untouched. Value checks are read back before the sync's
        # first write (layer 0's bias: nothing written) and at the end of the call (no host sync
        # per tensor): layer 1's NaN is found there, after the layer was written, and the model
        # refuses to generate until a complete sync.
        with pytest.raises(va.WeightSyncError, match=match):
            v.model.load_weights(iter(bad))
        after = state(v.model)
        if case in ("shape", "int_dtype"):
            assert torch.equal(after["model.layers.1.mlp.gate_up_proj.weight"],
                               before["model.layers.1.mlp.gate_up_proj.weight"])
        if case == "nan":
            assert v.model._npu_flashrl_loader.inconsistent is not None
        if case == "inf_bias":
            assert v.model._npu_flashrl_loader.inconsistent is None
            assert_same_state(after, before)
        assert v.model._npu_flashrl_loader.pending() == {}


def test_fp32_masters_quantize_like_their_bf16_cast(va, ckpts):
    dirs, models = ckpts
    # fp32 masters whose bf16 cast is models[1]: add sub-bf16 noise that the cast removes
    fp32 = []
    for n, t in hf_weights(models[1]):
        f = t.float()
        fp32.append((n, f + (f.abs() * 2e-4) * torch.rand_like(f) * 0.001))
    assert any(not torch.equal(f, t.float()) for (_, f), (_, t) in zip(fp32, hf_weights(models[1])))
    with build(va, dirs[0]) as v:
        v.model.load_weights([(n, t.to(torch.bfloat16)) for n, t in fp32])
        va.end_weight_sync(v.model)
        want = state(v.model)
        v.model.load_weights(hf_weights(models[2]))
        va.end_weight_sync(v.model)  # one sync each: a sync sends each tensor once
        v.model.load_weights(fp32)
        va.end_weight_sync(v.model)
        assert_same_state(state(v.model), want)


# --------------------------------------------------------------------------- checkpoints

def test_compressed_tensors_w8a8_loads_on_ascend_w8a8_dynamic(va, ckpts, tmp_path):
    from safetensors import safe_open

    from npu_flashrl.sim.checkpoints import write_w8a8_compressed_tensors

    dirs, models = ckpts
    w8 = str(tmp_path / "w8a8")
    write_w8a8_compressed_tensors(dirs[0], w8, smooth=False)
    raw = {}
    for f in os.listdir(w8):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(w8, f), "pt") as sf:
                raw.update({k: sf.get_tensor(k) for k in sf.keys()})
    with build(va, w8, fn=None) as v:
        from npu_flashrl import lines
        dyn = lines.current().method_class("W8A8_DYNAMIC", "linear")
        layer = v.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(layer.quant_method.quant_method, dyn)
        q = torch.cat([raw[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(layer.weight.data, q.t())
        assert torch.count_nonzero(layer.weight_offset.data) == 0
        linear_outputs_close(v.model, models[0])


@pytest.mark.parametrize("field,value", [("symmetric", False), ("strategy", "group"), ("type", "float")])
def test_unsupported_compressed_tensors_scheme_is_refused(va, field, value):
    from npu_flashrl.sim.checkpoints import w8a8_quantization_config

    cfg = w8a8_quantization_config()
    cfg["config_groups"]["group_0"]["weights"][field] = value
    with pytest.raises(va.UnsupportedScheme, match=rf"weights\.{field} = {value!r}"):
        va.compressed_tensors_description(cfg)


def test_modelslim_static_w8a8_keeps_qwen2_bias(va, ckpts, tmp_path):
    from modelslim_writer import write_modelslim_w8a8

    dirs, models = ckpts
    ms = str(tmp_path / "modelslim")
    write_modelslim_w8a8(dirs[0], ms, input_scale=0.02)
    with build(va, ms, fn=None) as v:
        from npu_flashrl import lines
        static = lines.current().method_class("W8A8", "linear")
        layer = v.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(layer.quant_method.quant_method, static)
        # every projection is claimed by the registered static W8A8 scheme (adapters/vllm_ascend/schemes)
        assert {t.scheme.key for t in v.model._npu_flashrl_loader.targets.values()} == {("W8A8", "linear")}
        assert torch.count_nonzero(layer.quant_bias) > 0, "float bias was not folded"
        hf = models[0].model.layers[0].self_attn
        w = torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight]).float()
        b = torch.cat([hf.q_proj.bias, hf.k_proj.bias, hf.v_proj.bias]).float()
        x = (torch.rand(6, w.shape[1]) * 4 - 2).to(torch.bfloat16)  # within 127*0.02
        ref = x.float() @ w.t() + b
        out, _ = layer(x)
        # static per-tensor activations: coarser than per-token; bias must be there (it is
        # ~10% of the output norm, so dropping it fails this bound)
        assert (out.float() - ref).norm() / ref.norm() < 0.05
        no_bias = x.float() @ w.t()
        assert (out.float() - no_bias).norm() / ref.norm() > 0.05


def test_schemes_are_registered_by_quant_type_and_layer_type(va):
    """The reload's schemes, keyed as vllm-ascend keys its own; a key is taken once, and a layer
    type the reload does not know is refused by name."""
    from npu_flashrl.adapters.vllm_ascend import schemes

    assert [s.key for s in schemes.registered()] == [
        ("W8A8_DYNAMIC", "linear"), ("W8A8_DYNAMIC", "moe"), ("W8A8", "linear"),
        ("W4A8_DYNAMIC", "linear"), ("W4A8_DYNAMIC", "moe")]
    assert schemes.get_scheme("W8A8_DYNAMIC", "moe").wire is schemes.PER_CHANNEL_INT8
    assert schemes.get_scheme("W4A8_DYNAMIC", "moe").wire is None  # float wire only
    with pytest.raises(ValueError, match=r"scheme \('W8A8', 'linear'\) registered twice"):
        schemes.register_scheme("W8A8", "linear")(type("Other", (schemes.get_scheme("W8A8", "linear").__class__,), {}))
    with pytest.raises(ValueError, match="layer type 'attention'"):
        schemes.register_scheme("W8A8", "attention")
    with pytest.raises(va.UnsupportedScheme, match="no in-place reload for vllm-ascend W8A16 linear"):
        schemes.get_scheme("W8A16", "linear")


# --------------------------------------------------------------------------- FlashRL profile

def test_profile_reload_matches_flashrl_int8(va, ckpts, tmp_path, monkeypatch):
    import flash_rl.flash_quantization as fq

    from npu_flashrl.profile import compute_int8_profile
    from npu_flashrl.sim.checkpoints import write_w8a8_compressed_tensors

    dirs, models = ckpts
    w8 = str(tmp_path / "w8a8s")
    write_w8a8_compressed_tensors(dirs[0], w8, smooth=True)
    profile = compute_int8_profile(dirs[0], w8, progress=False)
    # FlashRL's quantizer asks CUDA for a device; on CPU it must compute where the tensors are.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    with build(va, w8, fn="int8", profile=profile) as v:
        scales_before = {n: p.clone() for n, p in v.model.named_parameters() if n.endswith("weight_scale")}
        new = hf_weights(models[1])
        v.model.load_weights(new)
        va.end_weight_sync(v.model)
        flash = dict(fq.flash_quantize(hf_weights(models[1]), profile))
        p = dict(v.model.named_parameters())
        for i in range(2):
            q = torch.cat([flash[f"model.layers.{i}.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
            assert torch.equal(p[f"model.layers.{i}.self_attn.qkv_proj.weight"], q.t())
            d = flash[f"model.layers.{i}.mlp.down_proj.weight"]
            assert torch.equal(p[f"model.layers.{i}.mlp.down_proj.weight"], d.t())
            ln = f"model.layers.{i}.input_layernorm.weight"
            assert torch.equal(p[ln], flash[ln].to(p[ln].dtype))
        for n, s in scales_before.items():
            assert torch.equal(p[n], s), f"{n}: profile mode must keep the checkpoint's scales"


# --------------------------------------------------------------------------- TP=2

def _tp_worker(rank, port, dirs, out_dir):
    vllm_ascend = cpu_vllm.prepare_int8_worker()
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.bfloat16)
    with cpu_vllm.CpuVllm(dirs[0], quantization="ascend", tp_size=2, rank=rank, choice=cpu_vllm.int8(),
                          init_method=f"tcp://127.0.0.1:{port}") as v:
        ptr = v.model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()
        v.model.load_weights([(n, p.detach()) for n, p in new.named_parameters()])
        vllm_ascend.end_weight_sync(v.model)
        assert v.model.model.layers[0].self_attn.qkv_proj.weight.data_ptr() == ptr
        torch.save(state(v.model), os.path.join(out_dir, f"rank{rank}.pt"))


def test_tensor_parallel_2_each_rank_gets_its_shard(ckpts, tmp_path):
    import torch.multiprocessing as mp

    dirs, models = ckpts
    port = cpu_vllm.free_port()
    mp.start_processes(_tp_worker, args=(port, dirs, str(tmp_path)), nprocs=2, start_method="spawn")
    hf = models[1]
    cfg = hf.config
    head = cfg.hidden_size // cfg.num_attention_heads
    for rank in range(2):
        st = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        for i in range(cfg.num_hidden_layers):
            a = hf.model.layers[i]
            parts = []
            for n, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads),
                             ("v_proj", cfg.num_key_value_heads)):
                q, s = kernels.quantize_weight_per_channel(getattr(a.self_attn, n).weight.detach())
                rows = heads // 2 * head
                parts.append(q[rank * rows:(rank + 1) * rows])
            assert torch.equal(st[f"model.layers.{i}.self_attn.qkv_proj.weight"], torch.cat(parts).t())
            # row-parallel: full-row scales (as a fresh load computes them), column shard of int8
            q, s = kernels.quantize_weight_per_channel(a.mlp.down_proj.weight.detach())
            cols = cfg.intermediate_size // 2
            assert torch.equal(st[f"model.layers.{i}.mlp.down_proj.weight"],
                               q[:, rank * cols:(rank + 1) * cols].t())
            torch.testing.assert_close(st[f"model.layers.{i}.mlp.down_proj.weight_scale"].float(), s,
                                       rtol=4e-3, atol=0)


def test_each_registered_scheme_brings_one_run_once_patch_on_its_tables_class(va):
    """Schemes by key: a scheme's class is the one the installed line's own table holds for its
    key, its run-once patch is declared once per key (named by the scheme, the target naming the
    table entry) and applied to that class; the supported list a refusal names is the registry."""
    from npu_flashrl import lines, patches
    from npu_flashrl.adapters.vllm_ascend import schemes

    ln = lines.current()
    declared = {p["name"]: p for p in patches.status()}
    once = schemes.once_patches(ln)
    assert [p.name for p in once] == ["ascend_w8a8_dynamic_process_once",
                                      "ascend_w8a8_dynamic_moe_process_once",
                                      "ascend_w8a8_static_process_once",
                                      "ascend_w4a8_dynamic_linear_process_once",
                                      "ascend_w4a8_dynamic_moe_process_once"]
    for scheme, patch in zip(schemes.registered(), once):
        cls = scheme.method_class(ln)
        assert cls is ln.method_class(*scheme.key)
        assert patch.target == f"{ln.quant_method_map}[{scheme.quant_type!r}, {scheme.layer_type!r}]" \
                               ".process_weights_after_loading"
        assert declared[patch.name]["target"] == patch.target
        assert patches.apply_patch(patch.name)
        assert patches.original(cls.process_weights_after_loading) is not cls.process_weights_after_loading
    assert set(p.name for p in once) <= set(va.PATCHES)
    assert schemes.supported("linear") == ["W8A8_DYNAMIC", "W8A8", "W4A8_DYNAMIC"]
    assert schemes.supported("moe") == ["W8A8_DYNAMIC", "W4A8_DYNAMIC"]
    assert "supported: AscendW8A8DynamicLinearMethod, AscendW8A8LinearMethod" in ln.unsupported_reason(
        object(), [schemes.get_scheme(*k).method_class(ln).__name__
                   for k in (("W8A8_DYNAMIC", "linear"), ("W8A8", "linear"))])


def test_quant_type_constants_live_in_their_scheme_modules(va):
    from npu_flashrl.adapters.vllm_ascend import description
    from npu_flashrl.adapters.vllm_ascend.schemes import w8a8_dynamic, w8a8_static

    assert description.W8A8_DYNAMIC is w8a8_dynamic.W8A8_DYNAMIC
    assert description.W8A8 is w8a8_static.W8A8
    assert "W8A8_DYNAMIC = " not in open(description.__file__).read()
