"""MoE checkpoints: the compressed-tensors W8A8 writer, the vllm-ascend description and
the cold load of a tiny Qwen3-MoE.

Real code throughout: transformers builds and saves the tiny Qwen3-MoE (fused experts on
transformers 5, one nn.Linear per expert on 4.57), compressed-tensors computes and compresses the
int8 weights, vLLM builds Qwen3MoeForCausalLM and vllm-ascend picks its methods from our
description (`get_quant_method` of its "ascend" config) and loads the checkpoint.
Stand-ins (CPU harness, `va` fixture): torch_npu's kernels (npu_flashrl.kernels.emulation),
vLLM's CPU platform accepting "ascend", plain attention, and the HCCL side of vllm-ascend's mc2
group (cpu_vllm._mc2_without_hccl). Nothing is downloaded.
"""
import json
import os
import shutil
import types

import pytest
import torch

pytestmark = pytest.mark.every_line  # transformers / compressed-tensors / vLLM / vllm-ascend per line

E, LAYERS = 8, 2
PROJ = ("gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _load_all(model_dir):
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), "pt") as sf:
                out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny bf16 Qwen3-MoE, its w8a8 checkpoint with and without smoothing, and a config-only
    directory (load_format=dummy). Built before the `va` fixture touches the process."""
    pytest.importorskip("compressed_tensors")
    from npu_flashrl.sim.checkpoints import write_w8a8_compressed_tensors
    from npu_flashrl.sim.tiny_models import build_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("moe")
    bf16 = str(root / "bf16")
    model = build_tiny_qwen3_moe(bf16, seed=0)
    smooth = write_w8a8_compressed_tensors(bf16, str(root / "w8a8"))
    plain = write_w8a8_compressed_tensors(bf16, str(root / "w8a8_plain"), smooth=False)
    cfg_only = root / "config_only"
    cfg_only.mkdir()
    shutil.copy(os.path.join(bf16, "config.json"), cfg_only / "config.json")
    return types.SimpleNamespace(bf16=bf16, smooth=smooth, plain=plain, cfg_only=str(cfg_only),
                                 model=model, t_bf16=_load_all(bf16), t_smooth=_load_all(smooth),
                                 t_plain=_load_all(plain))


def _expected_int8(t_bf16):
    """Oracle for what a llm-compressor MoE recipe quantizes: every 2-D weight of a decoder layer
    except the router `mlp.gate` (ignore "re:.*mlp.gate$"); taken from the tensors' shapes."""
    return sorted(n for n, t in t_bf16.items()
                  if n.startswith("model.layers.") and n.endswith(".weight") and t.dim() == 2
                  and not n.endswith(".mlp.gate.weight"))


def _reference_int8(w):
    """int8 symmetric per-output-channel, as compressed-tensors defines it, computed here with
    torch alone: scale = absmax / 127.5 (its `bit_range / 2` for int8 is 255 / 2, not 127), stored
    in the weight's dtype; q = round_half_even(w / scale) clamped to [-128, 127], the division
    in the weight's dtype as its `_quantize` does."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127.5).to(w.dtype)
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def _bitwise_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --------------------------------------------------------------------------- the writer

def test_every_expert_is_int8_per_channel_like_an_independent_reference(moe):
    expected = _expected_int8(moe.t_bf16)
    experts = [n for n in expected if ".mlp.experts." in n]
    assert len(experts) == LAYERS * E * len(PROJ) and len(expected) == len(experts) + LAYERS * 4
    for tensors, smoothed in ((moe.t_plain, False), (moe.t_smooth, True)):
        quantized = sorted(n for n in tensors if n.endswith(".weight")
                           and n[: -len(".weight")] + ".weight_scale" in tensors)
        assert quantized == expected
        assert not any(n.endswith("weight_zero_point") for n in tensors)  # symmetric: none stored
        for name in expected:
            w, q, scale = moe.t_bf16[name], tensors[name], tensors[name[: -len(".weight")] + ".weight_scale"]
            assert q.dtype == torch.int8 and q.shape == w.shape
            assert scale.dtype == torch.bfloat16 and scale.shape == (w.shape[0], 1)
            if smoothed and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                continue  # smoothed by input_layernorm first (checked below)
            ref_q, ref_scale = _reference_int8(w)
            assert torch.equal(scale, ref_scale), name
            assert torch.equal(q, ref_q), name
            # every row uses the int8 range (its absmax lands on +-127.5 / scale: 127, or -128)
            assert int(q.int().abs().amax(dim=1).min()) >= 126, name
    # smoothing of a MoE layer is the attention side only: q/k/v differ, experts and o_proj not
    for i in range(LAYERS):
        q_name = f"model.layers.{i}.self_attn.q_proj.weight"
        assert not torch.equal(moe.t_smooth[q_name], moe.t_plain[q_name])


def test_router_norms_embeddings_copied_byte_for_byte(moe):
    ignore = ["lm_head", "re:.*mlp.gate$"]
    for d in (moe.plain, moe.smooth):
        with open(os.path.join(d, "config.json")) as f:
            qcfg = json.load(f)["quantization_config"]
        assert qcfg["ignore"] == ignore and qcfg["quant_method"] == "compressed-tensors"
        assert qcfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    copied = [n for n in moe.t_bf16 if n not in _expected_int8(moe.t_bf16)]
    routers = [n for n in copied if n.endswith(".mlp.gate.weight")]
    assert len(routers) == LAYERS and "model.embed_tokens.weight" in copied and "lm_head.weight" in copied
    for n in copied:  # without smoothing: everything that is not quantized, unchanged
        assert _bitwise_equal(moe.t_plain[n], moe.t_bf16[n]), n
    for n in copied:  # with smoothing: only the attention input norm absorbed the smoothing
        same = _bitwise_equal(moe.t_smooth[n], moe.t_bf16[n])
        assert same == (not n.endswith(".input_layernorm.weight")), n


def test_trainer_weights_are_the_checkpoint_names(moe):
    """What the trainer pushes (verl 0.9 unfuses transformers 5's packed experts with its own
    `unfuse_moe_params`; transformers 4.57's state dict is per-expert already) carries exactly the
    checkpoint's names and values."""
    from npu_flashrl.sim.tiny_models import trainer_weights

    pushed = trainer_weights(moe.model)
    names = [n for n, _ in pushed]
    assert len(names) == len(set(names)) and set(names) == set(moe.t_bf16)
    for n, t in pushed:
        assert _bitwise_equal(t.contiguous(), moe.t_bf16[n]), n


def test_transformers_loads_the_moe_checkpoint(moe):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe.plain, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    if hasattr(experts, "gate_up_proj"):
        pytest.skip("transformers with fused MoE experts (5.x, Qwen3MoeExperts.gate_up_proj): its "
                    "compressed-tensors integration only quantizes nn.Linear, so it loads the int8 "
                    "expert weights into the fused parameters, drops their weight_scale as "
                    "UNEXPECTED and its forward fails on int8 (seen with 5.5.4 / "
                    "compressed-tensors 0.17). vLLM loads the checkpoint (test below).")
    state = dict(model.named_parameters())
    for e in range(E):
        for p in PROJ:
            n = f"model.layers.1.mlp.experts.{e}.{p}"
            assert torch.equal(state[f"{n}.weight"], moe.t_plain[f"{n}.weight"])
            assert torch.equal(state[f"{n}.weight_scale"], moe.t_plain[f"{n}.weight_scale"])
    ref = AutoModelForCausalLM.from_pretrained(moe.bf16, dtype=torch.bfloat16)
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits.float(), model(ids).logits.float()
    # int8 weights + int8 per-token activations over 2 layers of a random tiny model: measured
    # 0.06; a load that ignored the scales or routed wrongly is ~1
    assert ((a - b).norm() / a.norm()).item() < 0.15


# --------------------------------------------------------------------------- the description

def _typing_oracle(name):
    """Expected vllm-ascend type of a checkpoint weight name."""
    if name.startswith("model.layers.") and (".mlp.experts." in name or any(
            f".self_attn.{p}." in name for p in ATTN)):
        return "W8A8_DYNAMIC"
    return "FLOAT"


@pytest.mark.parametrize("kind", ["bf16", "plain", "smooth", "cfg_only"])
def test_description_types_every_name(moe, kind):
    from npu_flashrl.adapters.vllm_ascend.description import describe_checkpoint

    desc = describe_checkpoint(getattr(moe, kind))
    weights = sorted(n for n in moe.t_bf16 if n.endswith(".weight"))
    if kind == "cfg_only":  # listed from config.json: every Linear weight and lm_head, nothing else
        linear = [n for n in weights if moe.t_bf16[n].dim() == 2 and n != "model.embed_tokens.weight"]
        assert sorted(desc) == linear
    else:
        assert sorted(desc) == weights
    for name in desc:
        assert desc[name] == _typing_oracle(name), name
    assert sum(v == "W8A8_DYNAMIC" for v in desc.values()) == LAYERS * (E * len(PROJ) + len(ATTN))
    # what vllm-ascend asks for the FusedMoE layer itself when no packed mapping names its experts
    assert desc["model.layers.0.mlp.experts.weight"] == "W8A8_DYNAMIC"


@pytest.mark.parametrize("kind", ["bf16", "smooth", "cfg_only"])
def test_vllm_ascend_picks_w8a8_dynamic_fused_moe_and_a_float_router(va, moe, kind):
    """vLLM builds Qwen3MoeForCausalLM under "ascend" (load_format=dummy: no weights are read) and
    vllm-ascend's own get_quant_method reads our description for every layer."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from npu_flashrl import lines
    from npu_flashrl.sim import cpu_vllm

    dyn = lines.current().method_class("W8A8_DYNAMIC", "linear")
    moe_cls = lines.current().method_class("W8A8_DYNAMIC", "moe")
    with cpu_vllm.CpuVllm(getattr(moe, kind), quantization="ascend", load_format="dummy",
                          choice=cpu_vllm.int8()) as v:
        for layer in v.model.model.layers:
            experts = layer.mlp.experts
            assert isinstance(experts.quant_method.quant_method, moe_cls)
            assert experts.w13_weight.dtype == torch.int8 and experts.w13_weight.shape[0] == E
            router = layer.mlp.gate
            assert router.weight.dtype == torch.bfloat16
            # vllm-ascend's AscendUnquantizedLinearMethod (0.11, 0.23) or vLLM's (v0.10.1rc1)
            assert isinstance(router.quant_method, UnquantizedLinearMethod)
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
                assert isinstance(proj.quant_method.quant_method, dyn)


# --------------------------------------------------------------------------- refusals

def _moe_qcfg():
    from npu_flashrl.sim.checkpoints import MOE_IGNORE, w8a8_quantization_config

    return w8a8_quantization_config(MOE_IGNORE)


@pytest.mark.parametrize("path,value,needle", [
    (("config_groups", "group_0", "weights", "strategy"), "group", r"weights\.strategy = 'group'"),
    (("config_groups", "group_0", "weights", "strategy"), "tensor", r"weights\.strategy = 'tensor'"),
    (("config_groups", "group_0", "weights", "num_bits"), 4, r"weights\.num_bits = 4"),
    (("config_groups", "group_0", "input_activations", "dynamic"), False,
     r"input_activations\.dynamic = False"),
    (("config_groups", "group_0", "targets"), ["re:.*experts.*", "Embedding"], r"\.targets = "),
    (("ignore",), "re:.*mlp.gate$", r"quantization_config\.ignore = 're:\.\*mlp\.gate\$'"),
    (("ignore",), ["lm_head", "re:.*mlp.gate($"], r"ignore: 're:\.\*mlp\.gate\(\$' is not a valid"),
])
def test_bad_compressed_tensors_moe_config_is_refused_naming_the_field(path, value, needle):
    from npu_flashrl.adapters.vllm_ascend.description import (UnsupportedScheme,
                                                              compressed_tensors_description)

    cfg = _moe_qcfg()
    assert compressed_tensors_description(cfg).ignore == ("lm_head", "re:.*mlp.gate$")
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(UnsupportedScheme, match=needle):
        compressed_tensors_description(cfg)


def _rewrite(src, dst, drop=()):
    """Copy checkpoint `src` to `dst` without the tensors `drop`."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    for f in os.listdir(src):
        path = os.path.join(src, f)
        if f.endswith(".safetensors"):
            save_file({k: v for k, v in load_file(path).items() if k not in drop},
                      os.path.join(dst, f), metadata={"format": "pt"})
        elif f == "model.safetensors.index.json":
            with open(path) as fh:
                data = json.load(fh)
            data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in drop}
            with open(os.path.join(dst, f), "w") as fh:
                json.dump(data, fh)
        else:
            shutil.copy(path, os.path.join(dst, f))
    return dst


def test_checkpoint_whose_int8_weights_disagree_with_the_description_is_refused(moe, tmp_path):
    from npu_flashrl.adapters.vllm_ascend.description import UnsupportedScheme, describe_checkpoint
    from npu_flashrl.sim.checkpoints import write_w8a8_compressed_tensors

    # a quantized router (ignore without the router): vllm-ascend would run int8 values as floats
    qrouter = write_w8a8_compressed_tensors(moe.bf16, str(tmp_path / "qrouter"), smooth=False,
                                            ignore=["lm_head"])
    with pytest.raises(UnsupportedScheme, match=r"model\.layers\.0\.mlp\.gate\.weight is stored int8"):
        describe_checkpoint(qrouter)
    # an expert whose scale is missing
    gone = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    broken = _rewrite(moe.plain, str(tmp_path / "noscale"), drop=(gone,))
    with pytest.raises(UnsupportedScheme, match=r"experts\.5\.up_proj\.weight has no .*weight_scale"):
        describe_checkpoint(broken)
    # some experts of a layer ignored, the others not: one FusedMoE method cannot run both
    mixed = write_w8a8_compressed_tensors(moe.bf16, str(tmp_path / "mixed"), smooth=False,
                                          ignore=["lm_head", "re:.*mlp.gate$", r"re:.*experts\.3\..*"])
    with pytest.raises(UnsupportedScheme, match=r"fused-MoE layer model\.layers\.0\.mlp\.experts are not all"):
        describe_checkpoint(mixed)


def test_config_only_moe_layout_follows_sparse_step_and_mlp_only_layers():
    from npu_flashrl.adapters.vllm_ascend.description import config_weight_names

    cfg = {"num_hidden_layers": 4, "num_experts": 3, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    names = config_weight_names(cfg)
    sparse = sorted({int(n.split(".")[2]) for n in names if ".mlp.experts." in n})
    assert sparse == [1]  # (i + 1) % 2 == 0 -> layers 1 and 3; 3 is mlp_only
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.3.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" not in names
    assert len([n for n in names if ".experts." in n]) == 3 * len(PROJ)
    with pytest.raises(ValueError, match=r"cfg\.json: decoder_sparse_step = 'x'"):
        config_weight_names(dict(cfg, decoder_sparse_step="x"), where="cfg.json")


# --------------------------------------------------------------------------- the cold load

def test_vllm_loads_the_compressed_tensors_moe_experts_as_stored(va, moe):
    """The policy's INT8 model from the W8A8 checkpoint, with vllm-ascend's W8A8_DYNAMIC fused-MoE method:
    after its post-processing each layer holds w13_weight [E, H, 2I] = [gate; up]^T and
    w2_weight [E, I, H] = down^T, int8 exactly as in the checkpoint, with its scales."""
    from npu_flashrl.sim import cpu_vllm

    t = moe.t_smooth
    with cpu_vllm.CpuVllm(moe.smooth, quantization="ascend", choice=cpu_vllm.int8()) as v:
        for i, layer in enumerate(v.model.model.layers):
            ex = layer.mlp.experts
            for e in range(E):
                pre = f"model.layers.{i}.mlp.experts.{e}"
                gate, up, down = (t[f"{pre}.{p}.weight"] for p in PROJ)
                gs, us, ds = (t[f"{pre}.{p}.weight_scale"] for p in PROJ)
                assert torch.equal(ex.w13_weight[e], torch.cat([gate, up]).t()), pre
                assert torch.equal(ex.w2_weight[e], down.t()), pre
                w13_scale = torch.cat([gs, us]).flatten().float()
                assert torch.equal(ex.w13_weight_scale[e].float(), w13_scale), pre
                assert torch.equal(ex.w2_weight_scale[e].float(), ds.flatten().float()), pre
            assert torch.equal(layer.mlp.gate.weight, t[f"model.layers.{i}.mlp.gate.weight"])
            assert torch.equal(layer.input_layernorm.weight, t[f"model.layers.{i}.input_layernorm.weight"])
