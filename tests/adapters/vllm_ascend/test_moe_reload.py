"""INT8 fused-MoE experts (Qwen3-MoE on vllm-ascend's W8A8_DYNAMIC fused-MoE scheme): cold load,
in-place reload in random buckets, refusals, TP=2 and expert parallel, on every stack line.

Real vLLM Qwen3MoeForCausalLM + vllm-ascend's AscendW8A8DynamicFusedMoEMethod (build, weight
loading through vLLM FusedMoE's own `weight_loader`, post-processing) on the CPU; a tiny Qwen3-MoE
(2 layers, 8 experts, top-2) built offline. The trainer's weights are what verl sends
(`sim.tiny_models.trainer_weights`: verl 0.9's own `unfuse_moe_params` on transformers 5).
Stand-ins: torch_npu (reference kernels), vLLM attention (plain SDPA), the HCCL name of
vllm-ascend's mc2 group (`cpu_vllm._mc2_without_hccl`), verl's IPC sender (`sim.sync.
BucketBuffer`: views of one reused buffer, overwritten with NaN after every bucket).
"""
import os
import tempfile

import pytest
import torch

from npu_flashrl import kernels, lines
from npu_flashrl.quant import WeightSyncError
from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import (BucketBuffer, assert_same_state, bucket_bytes, post_sync,
                                      ptrs, random_buckets, state)
from npu_flashrl.sim.tiny_models import build_tiny_qwen3_moe, trainer_weights

from helpers import build, deliver_spread_experts, fresh_states, layerwise_reload, verl_npu_fused_moe

pytestmark = pytest.mark.every_line

LAYERS, EXPERTS = 2, 8


@pytest.fixture(scope="module")
def moe():
    root = tempfile.mkdtemp(prefix="npu_flashrl_moe_")
    dirs, models = [], []
    for seed in range(4):
        d = os.path.join(root, f"w{seed}")
        models.append(build_tiny_qwen3_moe(d, seed=seed, tokenizer=False))
        dirs.append(d)
    return dirs, models


def hf_experts(hf, i):
    """{expert: (gate, up, down)} of decoder layer i, as the trainer sends them."""
    w = dict(trainer_weights(hf))
    p = f"model.layers.{i}.mlp.experts"
    return {e: tuple(w[f"{p}.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            for e in range(EXPERTS)}


def expected_experts(hf, i, rank=0, tp=1, experts=None):
    """The processed int8 / scales a fused-MoE layer must hold: per-channel INT8 of each expert
    (rows of the full projection, then this TP rank's slice), transposed like post-processing."""
    w13, w2, s13, s2 = [], [], [], []
    for e, (g, u, d) in sorted(hf_experts(hf, i).items()):
        if experts is not None and e not in experts:
            continue
        (qg, sg), (qu, su), (qd, sd) = (kernels.quantize_weight_per_channel(t, torch.bfloat16)
                                        for t in (g, u, d))
        n = qg.shape[0] // tp
        rows = slice(rank * n, (rank + 1) * n)
        w13.append(torch.cat([qg[rows], qu[rows]]).t())
        s13.append(torch.cat([sg[rows], su[rows]]))
        w2.append(qd[:, rows].t())
        s2.append(sd)
    return torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2)


def check_experts(model, hf, rank=0, tp=1, experts=None):
    for i in range(LAYERS):
        layer = model.get_submodule(f"model.layers.{i}.mlp.experts")
        w13, w2, s13, s2 = expected_experts(hf, i, rank, tp, experts)
        assert layer.w13_weight.dtype == torch.int8
        assert torch.equal(layer.w13_weight.data, w13), f"layer {i} w13"
        assert torch.equal(layer.w2_weight.data, w2), f"layer {i} w2"
        # scales are stored in the model dtype (bf16), as a fresh load stores them
        torch.testing.assert_close(layer.w13_weight_scale.data.float(), s13, rtol=4e-3, atol=0)
        torch.testing.assert_close(layer.w2_weight_scale.data.float(), s2, rtol=4e-3, atol=0)
        assert torch.equal(layer.w13_weight_scale_fp32, layer.w13_weight_scale.data.float())
        assert not layer.w13_weight_offset.data.any() and not layer.w2_weight_offset.data.any()
        # the router stays high precision
        gate = model.get_submodule(f"model.layers.{i}.mlp.gate")
        assert gate.weight.dtype == torch.bfloat16
        assert torch.equal(gate.weight.data, dict(trainer_weights(hf))[f"model.layers.{i}.mlp.gate.weight"])


def test_bf16_cold_load_gives_per_channel_int8_experts(va, moe):
    dirs, models = moe
    with build(va, dirs[0]) as v:
        loader = v.model._npu_flashrl_loader
        assert len(loader.experts) == LAYERS * EXPERTS * 3
        assert {t.scheme.key for t in loader.experts.values()} == {("W8A8_DYNAMIC", "moe")}
        check_experts(v.model, models[0])
        # the attention projections are W8A8_DYNAMIC too
        assert v.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8


def test_three_syncs_in_random_buckets_each_equal_a_fresh_load(va, moe):
    dirs, models = moe
    fresh = fresh_states(va, dirs, (1, 2, 3))
    with build(va, dirs[0]) as v:
        m = v.model
        before = ptrs(m)
        expert_bytes = 3 * 96 * 128 * 2  # gate + up + down of one expert, bf16
        for k in (1, 2, 3):
            deliver_spread_experts(m, trainer_weights(models[k]), k, expert_bytes)
            assert va.end_weight_sync(m) == []
            post_sync(v)
            assert_same_state(state(m), fresh[k])
            check_experts(m, models[k])
            assert ptrs(m) == before, "a sync must write the experts in place"
            assert m._npu_flashrl_loader.staging_bytes() == 0


def test_staging_holds_at_most_the_layers_being_received(va, moe):
    dirs, models = moe
    with build(va, dirs[0]) as v:
        m = v.model
        loader = m._npu_flashrl_loader
        layer = m.model.layers[0].mlp.experts
        one_layer = (layer.w13_weight.numel() + layer.w2_weight.numel()
                     + 4 * (layer.w13_weight_scale.numel() + layer.w2_weight_scale.numel()))
        peak = 0
        # layer by layer, as verl's sender walks the state dict: one layer staged at a time
        for name, t in trainer_weights(models[1]):
            m.load_weights([(name, t)])
            peak = max(peak, loader.staging_bytes())
        va.end_weight_sync(m)
        assert peak == one_layer
        check_experts(m, models[1])


def test_missing_expert_shard_is_named_and_blocks_generation_until_a_complete_sync(va, moe):
    dirs, models = moe
    with build(va, dirs[0]) as v:
        m = v.model
        lost = "model.layers.1.mlp.experts.5.down_proj.weight"
        m.load_weights([(n, t) for n, t in trainer_weights(models[1]) if n != lost])
        with pytest.raises(WeightSyncError, match=lost.replace(".", r"\.")):
            va.end_weight_sync(m)
        loader = m._npu_flashrl_loader
        assert loader.inconsistent is not None  # layer 0 was written, layer 1 was not
        layer1 = m.get_submodule("model.layers.1.mlp.experts")
        assert torch.equal(layer1.w13_weight.data, expected_experts(models[0], 1)[0]), \
            "the incomplete layer keeps its previous experts"
        with pytest.raises(WeightSyncError, match="two syncs"):
            m.model.layers[0].mlp.experts(torch.zeros(1, 128, dtype=torch.bfloat16),
                                          torch.zeros(1, EXPERTS, dtype=torch.bfloat16))
        m.load_weights(trainer_weights(models[2]))
        assert va.end_weight_sync(m) == []
        assert loader.inconsistent is None
        check_experts(m, models[2])


def test_a_sync_leaving_out_a_layers_experts_names_them_and_blocks_generation(va, moe):
    """A sync without ANY expert of layer 1 staged nothing there, so
    nothing was "missing" and it ended clean with layer 1's experts of the previous sync."""
    dirs, models = moe
    with build(va, dirs[0]) as v:
        m = v.model
        m.load_weights([(n, t) for n, t in trainer_weights(models[1])
                        if not n.startswith("model.layers.1.mlp.experts.")])
        with pytest.raises(WeightSyncError, match=r"never arrived since the last complete sync: "
                                                  r".*model\.layers\.1\.mlp\.experts\.0\.") as info:
            va.end_weight_sync(m)
        assert "refuses to generate" in str(info.value)
        with pytest.raises(WeightSyncError, match="two syncs"):
            m.model.layers[0].mlp.experts(torch.zeros(1, 128, dtype=torch.bfloat16),
                                          torch.zeros(1, EXPERTS, dtype=torch.bfloat16))
        m.load_weights(trainer_weights(models[2]))
        assert va.end_weight_sync(m) == []
        check_experts(m, models[2])


def test_an_expert_twice_in_one_call_is_refused_by_name(va, moe):
    """A tensor sent twice: the second copy re-staged the layer, and the sync was reported
    as other experts that "never arrived"."""
    dirs, models = moe
    with build(va, dirs[0]) as v:
        m = v.model
        before = state(m)
        name = "model.layers.0.mlp.experts.2.gate_proj.weight"
        good = trainer_weights(models[1])
        with pytest.raises(WeightSyncError, match=rf"^{name}: appears twice in one load_weights call"):
            m.load_weights(good + [(name, dict(good)[name].clone())])
        assert_same_state(state(m), before)
        assert m._npu_flashrl_loader.inconsistent is None


def test_bad_expert_tensors_are_refused_by_name_before_anything_is_written(va, moe):
    dirs, models = moe
    with build(va, dirs[0]) as v:
        m = v.model
        before = state(m)
        name = "model.layers.0.mlp.experts.3.up_proj.weight"
        good = trainer_weights(models[1])
        cases = {
            "shape": (torch.zeros(96, 127, dtype=torch.bfloat16), r"expected shape \(96, 128\)"),
            "dtype": (torch.zeros(96, 128, dtype=torch.int16), "floating-point"),
            "nan": (torch.full((96, 128), float("nan"), dtype=torch.bfloat16), "NaN"),
        }
        for what, (bad, msg) in cases.items():
            weights = [(n, bad if n == name else t) for n, t in good]
            with pytest.raises(WeightSyncError, match=msg) as info:
                m.load_weights(weights)
            assert name in str(info.value), what
            assert_same_state(state(m), before)
            assert m._npu_flashrl_loader.inconsistent is None, what
            with pytest.raises(WeightSyncError, match="nothing of it was written"):
                va.end_weight_sync(m)
        # an int8 expert weight in a float sync is an INT8-wire half whose scale may come later
        # (either order): its layer is never committed, and the end of the sync names the scale
        weights = [(n, torch.zeros(96, 128, dtype=torch.int8) if n == name else t) for n, t in good]
        m.load_weights(weights)
        with pytest.raises(WeightSyncError, match="INT8 wire") as info:
            va.end_weight_sync(m)
        assert name[: -len("weight")] + "weight_scale" in str(info.value)
        layer0 = m.model.layers[0].mlp.experts
        assert torch.equal(layer0.w13_weight, before["model.layers.0.mlp.experts.w13_weight"])
        m.load_weights(good)
        assert va.end_weight_sync(m) == []


def test_flashrl_int8_profile_is_refused_for_a_moe_model(va, moe):
    dirs, _ = moe
    # a dense profile (FlashRL format, as the engine's profile file holds it): no expert entries
    profile = {"model.layers.0.self_attn.q_proj.weight": {
        "input_scale": torch.ones(1, 128), "output_scale": torch.ones(192, 1), "type": torch.int8}}
    with pytest.raises(WeightSyncError, match="int8_profile_free") as info:
        with build(va, dirs[0], fn="int8", profile=profile):
            pass
    assert "MoE" in str(info.value) and "experts" in str(info.value)


# --------------------------------------------------------------------------- TP=2 / EP=2

def _tp_worker(rank, port, dirs, out_dir, expert_parallel):
    vllm_ascend = cpu_vllm.prepare_int8_worker()
    from transformers import AutoModelForCausalLM

    new = AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.bfloat16)
    vllm_config = cpu_vllm.make_vllm_config(dirs[0], quantization="ascend", tp_size=2,
                                            additional_config=_policy({}))
    vllm_config.parallel_config.enable_expert_parallel = expert_parallel
    with cpu_vllm.CpuVllm(dirs[0], quantization="ascend", tp_size=2, rank=rank,
                          init_method=f"tcp://127.0.0.1:{port}", vllm_config=vllm_config) as v:
        layer = v.model.model.layers[0].mlp.experts
        ptr = layer.w13_weight.data_ptr()
        local = [e for e in range(EXPERTS) if layer._map_global_expert_id_to_local_expert_id(e) != -1]
        v.model.load_weights(trainer_weights(new))
        vllm_ascend.end_weight_sync(v.model)
        assert layer.w13_weight.data_ptr() == ptr
        torch.save({"state": state(v.model), "local": local}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_each_hold_their_part_of_the_experts(moe, tmp_path, expert_parallel):
    """TP=2: every rank holds every expert, half of its intermediate rows. EP=2: each rank holds
    half of the experts, whole, by vLLM's expert map (vllm-ascend's AscendFusedMoE; its MC2 /
    all-to-all dispatchers, which need HCCL, are refusing stand-ins: see cpu_vllm)."""
    import torch.multiprocessing as mp

    dirs, models = moe
    port = cpu_vllm.free_port()
    mp.start_processes(_tp_worker, args=(port, dirs, str(tmp_path), expert_parallel), nprocs=2,
                       start_method="spawn")
    seen = set()
    for rank in range(2):
        saved = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        st, local = saved["state"], saved["local"]
        if expert_parallel:  # each rank holds half of the experts, whole
            assert len(local) == EXPERTS // 2
            tp, r, experts = 1, 0, set(local)
        else:  # every rank holds every expert, half of its intermediate rows
            assert local == list(range(EXPERTS))
            tp, r, experts = 2, rank, None
        seen |= set(local)
        for i in range(LAYERS):
            w13, w2, s13, _ = expected_experts(models[1], i, r, tp, experts)
            p = f"model.layers.{i}.mlp.experts"
            assert torch.equal(st[f"{p}.w13_weight"], w13), (rank, i)
            assert torch.equal(st[f"{p}.w2_weight"], w2), (rank, i)
            torch.testing.assert_close(st[f"{p}.w13_weight_scale"].float(), s13, rtol=4e-3, atol=0)
    assert seen == set(range(EXPERTS))


def test_vllm_layerwise_reload_of_the_moe_model_runs_through_the_run_once_guard(va, moe):
    """vLLM 0.23's own layerwise reload restores every layer (the fused-MoE one included) to its
    checkpoint layout and reruns post-processing: the run-once guard lets that run, the bf16
    trainer weights are quantized on the way by npu_flashrl's loader, and the in-place sync works
    again after it."""
    reload = layerwise_reload()
    dirs, models = moe
    fresh = fresh_states(va, dirs, (1, 2))
    with build(va, dirs[0]) as v:
        m = v.model
        before = ptrs(m)
        reload.initialize_layerwise_reload(m)
        buckets = random_buckets(trainer_weights(models[1]), seed=7, max_bytes=64 << 10)
        buffer = BucketBuffer(bucket_bytes(buckets))
        for bucket in buckets:
            buffer.deliver(m, bucket)
        reload.finalize_layerwise_reload(m, v.vllm_config.model_config)
        assert_same_state(state(m), fresh[1])
        check_experts(m, models[1])
        assert ptrs(m) == before
        m.load_weights(trainer_weights(models[2]))
        va.end_weight_sync(m)
        post_sync(v)
        assert_same_state(state(m), fresh[2])
        assert ptrs(m) == before


# --------------------------------------------------------------------------- vllm-ascend settings

def _policy(additional):
    """`additional` (vllm-ascend settings) plus the INT8 choice the engine patch records."""
    from npu_flashrl.adapters.engine_choice import with_choice

    return with_choice(additional, cpu_vllm.int8())


def _with_additional_config(model_dir, additional):
    return cpu_vllm.make_vllm_config(model_dir, quantization="ascend",
                                     additional_config=_policy(additional))


def test_fused_mc2_scales_follow_every_sync(va, moe):
    """With `enable_fused_mc2`, vllm-ascend 0.23's post-processing keeps the int64 bit patterns of
    both expert scales (`fused_w1_scale` / `fused_w2_scale`) for its fused MC2 kernel: each sync
    rewrites them as a fresh load computes them (vllm-ascend's own converter)."""
    if lines.current().layout != "023":
        pytest.skip("enable_fused_mc2 is a vllm-ascend 0.23 setting")
    dirs, models = moe
    cfg = {"enable_fused_mc2": 1}
    with cpu_vllm.CpuVllm(dirs[1], quantization="ascend", vllm_config=_with_additional_config(dirs[1], cfg)) as f:
        fresh = [(f.model.model.layers[i].mlp.experts.fused_w1_scale.clone(),
              f.model.model.layers[i].mlp.experts.fused_w2_scale.clone()) for i in range(LAYERS)]
    try:
        with cpu_vllm.CpuVllm(dirs[0], quantization="ascend",
                              vllm_config=_with_additional_config(dirs[0], cfg)) as v:
            layers = [v.model.model.layers[i].mlp.experts for i in range(LAYERS)]
            old = [l.fused_w1_scale.clone() for l in layers]
            ptr = [l.fused_w1_scale.data_ptr() for l in layers]
            v.model.load_weights(trainer_weights(models[1]))
            va.end_weight_sync(v.model)
            for i, layer in enumerate(layers):
                assert layer.fused_w1_scale.dtype == torch.int64
                assert not torch.equal(layer.fused_w1_scale, old[i])
                assert torch.equal(layer.fused_w1_scale, fresh[i][0]), i
                assert torch.equal(layer.fused_w2_scale, fresh[i][1]), i
                assert layer.fused_w1_scale.data_ptr() == ptr[i]
    finally:
        with cpu_vllm.CpuVllm(dirs[0], quantization="ascend", choice=cpu_vllm.int8()):
            pass  # vllm-ascend's config is per process: back to the defaults for the next test


def _eplb_worker(rank, port, model_dir, out):
    os.environ["DYNAMIC_EPLB"] = "true"  # vllm-ascend asserts it is set with dynamic_eplb
    vllm_ascend = cpu_vllm.prepare_int8_worker()
    vllm_config = _with_additional_config(model_dir, {"eplb_config": {"dynamic_eplb": True}})
    try:
        with cpu_vllm.CpuVllm(model_dir, quantization="ascend", vllm_config=vllm_config,
                              init_method=f"tcp://127.0.0.1:{port}", ascend_moe_layers=False):
            result = "built"
    except vllm_ascend.UnsupportedScheme as exc:
        result = f"refused: {exc}"
    with open(out, "w") as f:
        f.write(result)


def test_dynamic_eplb_is_refused_by_name(va, moe, tmp_path):
    """Under dynamic EPLB vllm-ascend keeps the experts in per-expert copies that move between
    slots at run time: refused when the engine is built, naming the setting. (vllm-ascend's
    AscendFusedMoE itself refuses dynamic EPLB without expert parallelism, which needs HCCL at
    build on the CPU: vLLM's own FusedMoE carries the scheme here, in a fresh process.)"""
    import torch.multiprocessing as mp

    if lines.current().layout != "023":
        pytest.skip("eplb_config.dynamic_eplb is how vllm-ascend 0.23 spells it")
    dirs, _ = moe
    out = str(tmp_path / "result.txt")
    mp.start_processes(_eplb_worker, args=(cpu_vllm.free_port(), dirs[0], out), nprocs=1,
                       start_method="spawn")
    result = open(out).read()
    assert result.startswith("refused:") and "dynamic EPLB" in result, result
    assert "model.layers.0.mlp.experts" in result


def test_verl_npu_transpose_wrapper_does_not_misplace_square_experts(va, tmp_path, monkeypatch):
    """verl 0.9 on an NPU wraps vLLM's FusedMoE.weight_loader (`verl.utils.vllm.npu_vllm_patch`,
    applied when `verl.utils.vllm` is imported) to transpose post-processed bf16 experts. With
    2 x moe_intermediate == hidden its shape test also fires on npu_flashrl's checkpoint-layout
    staging: the in-place reload steps around it. verl's own wrapper, installed by verl's own
    function after the engine was built (the wrapper misreads such a model's cold load as well:
    verl's, not a path of npu_flashrl's)."""
    FusedMoE, npu_patch = verl_npu_fused_moe(monkeypatch)
    dirs, models = [], []
    for seed in (0, 1):  # hidden 128 = 2 x moe_intermediate 64
        d = str(tmp_path / f"sq{seed}")
        models.append(build_tiny_qwen3_moe(d, seed=seed, tokenizer=False,
                                           config_overrides={"moe_intermediate_size": 64}))
        dirs.append(d)
    with build(va, dirs[0]) as v:
        m = v.model
        assert npu_patch._patch_legacy_fused_moe_weight_loader(FusedMoE)
        assert getattr(FusedMoE.weight_loader, "_verl_npu_weight_loader_patched", False)
        m.load_weights(trainer_weights(models[1]))
        assert va.end_weight_sync(m) == []
        for i in range(LAYERS):
            w13, w2, s13, _ = expected_experts(models[1], i)
            layer = m.get_submodule(f"model.layers.{i}.mlp.experts")
            assert torch.equal(layer.w13_weight.data, w13), i
            assert torch.equal(layer.w2_weight.data, w2), i
            torch.testing.assert_close(layer.w13_weight_scale.data.float(), s13, rtol=4e-3, atol=0)
