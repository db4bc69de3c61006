"""W4A8 MoE rollouts: a policy Qwen3-MoE of vllm-ascend's W4A8_DYNAMIC fused-MoE (and linear)
layers, cold-loaded from a ModelSlim W4A8 checkpoint (group size 256), takes the trainer's bf16
weights at every sync, and after every sync equals a fresh W4A8 load of the same weights bit for
bit (the packed int4 experts, the fused int64 scales, the scale_bias, every other parameter),
with every data pointer unchanged; bucketed in any split, through a reused IPC buffer; refused
or complete.

Real code: vLLM's Qwen3MoeForCausalLM and FusedMoE `weight_loader` (expert map, w1/w3 offsets),
vllm-ascend's AscendModelSlimConfig and `AscendW4A8DynamicFusedMoEMethod` (create_weights,
post-processing, and the `process_scale` / `pack_to_int32` the scheme's commit calls), vLLM's
`process_weights_after_loading` as verl 0.9 runs it after every sync. Stand-ins (named):
torch_npu (the emulation: `kernels.int4_moe` packs the experts), the mc2 group's HCCL name
(`cpu_vllm._mc2_without_hccl`), vLLM's CPU platform accepting "ascend", plain causal attention,
verl's IPC sender (`sim.sync.BucketBuffer`: views of one reused buffer, overwritten with NaN after
every bucket); the checkpoints are written by the tests' ModelSlim-format writer with
npu_flashrl's staged quantizer.
"""
import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import post_sync, ptrs, state
from npu_flashrl.sim.tiny_models import trainer_weights

from helpers import assert_equal_states, deliver_spread_experts
from w4a8_moe_models import build_pair

pytestmark = pytest.mark.every_line
W4A8_FN = "w4a8_profile_free"


@pytest.fixture(scope="module")
def ckpts(va, tmp_path_factory):
    """{seed: (ModelSlim W4A8 dir, HF bf16 model, fresh W4A8 load's state)} for two weight sets."""
    from transformers import AutoModelForCausalLM

    from npu_flashrl import lines

    cpu_vllm.prepare_process()
    if lines.current().method_class("W4A8_DYNAMIC", "moe") is None:
        pytest.skip(f"vllm-ascend {lines.current().vllm_ascend} has no W4A8_DYNAMIC fused-MoE method")
    root = str(tmp_path_factory.mktemp("w4a8_moe_sync"))
    out = {}
    for seed in (0, 1):
        bf16, ms = build_pair(root, seed)
        fresh = None  # (a line that refuses W4A8 MoE reloads: the refusal test needs none)
        if lines.current().w4a8_moe_cast is not None:
            with cpu_vllm.CpuVllm(ms, quantization="ascend") as v:  # vllm-ascend's own load
                assert getattr(v.model, "_npu_flashrl_loader", None) is None
                fresh = state(v.model)
        out[seed] = (ms, AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16), fresh)
    return out


@pytest.fixture
def reloaded_line():
    """The sync tests run where the W4A8 MoE scheme writes (0.23, 0.11)."""
    from npu_flashrl import lines

    ln = lines.current()
    if ln.w4a8_moe_cast is None:
        pytest.skip(f"vllm-ascend {ln.vllm_ascend}: W4A8 MoE layers are refused at engine build "
                    "(test_w4a8_moe_on_a_line_without_its_reload_is_refused_at_engine_build)")


def policy(ms_dir, fn=W4A8_FN):
    return cpu_vllm.CpuVllm(ms_dir, quantization="ascend", choice=cpu_vllm.int8(fn))


def test_every_sync_equals_a_fresh_w4a8_moe_load_in_place(va, ckpts, reloaded_line):
    (ms0, hf0, want0), (_, hf1, want1) = ckpts[0], ckpts[1]
    want = {0: want0, 1: want1}
    with policy(ms0) as v:
        m = v.model
        loader = m._npu_flashrl_loader
        assert {t.scheme.key for t in loader.experts.values()} == {("W4A8_DYNAMIC", "moe")}
        assert {t.scheme.key for t in loader.targets.values()} == {("W4A8_DYNAMIC", "linear")}
        assert_equal_states(state(m), want[0])  # the cold load is vllm-ascend's own
        before = ptrs(m)
        expert_bytes = 3 * 256 * 256 * 2  # gate + up + down of one expert, bf16
        for step, (seed, hf) in enumerate(((1, hf1), (0, hf0), (1, hf1))):
            deliver_spread_experts(m, trainer_weights(hf), step, expert_bytes)
            assert va.end_weight_sync(m) == []
            post_sync(v)  # verl 0.9 runs post-processing after every sync: a no-op here
            assert_equal_states(state(m), want[seed])
            assert ptrs(m) == before, "a sync must write the experts in place"
            assert loader.staging_bytes() == 0
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4, 5]]))).all()


def test_a_nan_expert_is_refused_by_name_and_nothing_is_written(va, ckpts, reloaded_line):
    (ms0, _, want0), (_, hf1, _) = ckpts[0], ckpts[1]
    from npu_flashrl.quant import WeightSyncError

    with policy(ms0) as v:
        bad = [(n, t.clone()) for n, t in trainer_weights(hf1)]
        name = "model.layers.1.mlp.experts.5.down_proj.weight"
        i = next(k for k, (n, _) in enumerate(bad) if n == name)
        bad[i][1][3, 7] = float("nan")
        with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
            v.model.load_weights(bad)
        with pytest.raises(WeightSyncError, match="weight sync failed"):
            va.end_weight_sync(v.model)
        assert_equal_states(state(v.model), want0)


def test_a_missing_expert_is_named_and_its_layer_keeps_its_experts(va, ckpts, reloaded_line):
    """Layer 1 never completes: it keeps the previous sync's experts while layer 0 took the new
    ones, so the model refuses to generate until a complete sync."""
    (ms0, _, want0), (_, hf1, want1) = ckpts[0], ckpts[1]
    from npu_flashrl.quant import WeightSyncError

    with policy(ms0) as v:
        m = v.model
        lost = "model.layers.1.mlp.experts.2.up_proj.weight"
        m.load_weights([(n, t) for n, t in trainer_weights(hf1) if n != lost])
        with pytest.raises(WeightSyncError, match=lost.replace(".", r"\.")):
            va.end_weight_sync(m)
        got = state(m)
        for n in want0:
            if n.startswith("model.layers.1.mlp.experts."):
                assert torch.equal(got[n], want0[n]), f"{n}: the incomplete layer was written"
            elif n.startswith("model.layers.0.mlp.experts."):
                assert torch.equal(got[n], want1[n]), f"{n}: the complete layer was not written"
        assert m._npu_flashrl_loader.inconsistent is not None
        m.load_weights(trainer_weights(hf1))
        assert va.end_weight_sync(m) == []
        assert m._npu_flashrl_loader.inconsistent is None
        assert_equal_states(state(m), want1)


def test_int8_fn_on_a_w4a8_moe_model_is_refused_at_engine_build(va, ckpts, reloaded_line):
    from npu_flashrl.quant import WeightSyncError

    with pytest.raises(WeightSyncError, match="W4A8_DYNAMIC"):
        with policy(ckpts[0][0], fn="int8_profile_free"):
            pass


def test_w4a8_moe_on_a_line_without_its_reload_is_refused_at_engine_build(va, ckpts):
    """v0.10.1rc1's W4A8 MoE post-processing keeps another layout: refused by name, not
    written into."""
    from npu_flashrl import lines
    from npu_flashrl.adapters.vllm_ascend.schemes import UnsupportedScheme

    if lines.current().w4a8_moe_cast is not None:
        pytest.skip(f"vllm-ascend {lines.current().vllm_ascend} reloads W4A8 MoE layers")
    with pytest.raises(UnsupportedScheme, match=r"model\.layers\.0\.mlp\.experts: vllm-ascend .*W4A8_DYNAMIC "
                                                r"fused-MoE post-processing keeps another processed layout"):
        with policy(ckpts[0][0]):
            pass
