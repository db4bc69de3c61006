"""W4A8 MoE rollouts in vllm-ascend's per-channel mode (`AscendW4A8DynamicFusedMoEMethod` with
the description's `group_size` 0, the form of ModelSlim's per-channel W4A8 MoE recipes): a policy
Qwen3-MoE whose experts are W4A8_DYNAMIC per-channel (one fp32 scale per output channel, no
second level) and whose other projections stay FLOAT (vllm-ascend's W4A8 linear method has no
per-channel mode), cold-loaded from that ModelSlim checkpoint, takes the trainer's bf16 weights
at every sync and after every sync equals a fresh load of the same weights bit for bit (packed
int4 experts, the int64 fp32-bit scales, every other parameter), data pointers unchanged. The
FlashRL entry's `group_size: 0` must match the checkpoint's; a bare bf16 checkpoint with it is
refused naming the key.

Real code: vLLM's Qwen3MoeForCausalLM and FusedMoE `weight_loader`, vllm-ascend's
AscendModelSlimConfig and `AscendW4A8DynamicFusedMoEMethod` (create_weights in its per-channel
form, post-processing, the `process_scale` / `pack_to_int32` the scheme's commit calls), vLLM's
`process_weights_after_loading` as verl 0.9 runs it after every sync. Stand-ins (named):
torch_npu (the emulation: `kernels.int4_moe` packs the experts), the mc2 group's HCCL name
(`cpu_vllm._mc2_without_hccl`), vLLM's CPU platform accepting "ascend", plain causal attention,
verl's IPC sender (`sim.sync.BucketBuffer`); the checkpoints are written by the tests'
ModelSlim-format writer with npu_flashrl's per-channel rule (ModelSlim's own is compiled). The
per-channel forward is not run: its A8W4 call (vllm-ascend passes an empty scale_bias) is not
emulated (docs/w4a8.md, Fused MoE).
"""
import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import BucketBuffer, bucket_bytes, post_sync, ptrs, random_buckets, state
from npu_flashrl.sim.tiny_models import trainer_weights

from helpers import assert_equal_states
from w4a8_moe_models import (EXPERTS, HIDDEN, LAYERS, MOE_I, build_pair, expert_weights,
                             require_w4a8_moe_reload)

pytestmark = pytest.mark.every_line
W4A8_FN = "w4a8_profile_free"


@pytest.fixture(scope="module")
def ckpts(va, tmp_path_factory):
    """{seed: (bf16 dir, per-channel ModelSlim W4A8 dir, HF bf16 model, fresh load's state)}."""
    from transformers import AutoModelForCausalLM

    require_w4a8_moe_reload()
    root = str(tmp_path_factory.mktemp("w4a8_moe_pc"))
    out = {}
    for seed in (0, 1):
        bf16, ms = build_pair(root, seed, group_size=0)
        with cpu_vllm.CpuVllm(ms, quantization="ascend") as v:  # vllm-ascend's own load
            assert getattr(v.model, "_npu_flashrl_loader", None) is None
            fresh = state(v.model)
        out[seed] = (bf16, ms, AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16), fresh)
    return out


def policy(model_dir, group_size=None):
    from npu_flashrl.adapters.engine_choice import EngineChoice

    return cpu_vllm.CpuVllm(model_dir, quantization="ascend",
                            choice=EngineChoice(fn=W4A8_FN, group_size=group_size))


def _fp32_bits(t):
    return t.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def test_per_channel_experts_hold_the_fp32_bits_of_the_per_channel_rule(ckpts):
    """vllm-ascend's per-channel post-processing keeps each expert's fp32 scale as its bit pattern
    in int64 (not rounded through fp16 as the per-group scales are) and registers no second level:
    what the kernels' per-channel rule predicts, bit for bit, from the float experts."""
    from npu_flashrl.kernels import int4

    _, ms, hf, fresh = ckpts[0]
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts."
        assert not any(n.startswith(p) and "second" in n for n in fresh)
        assert fresh[p + "w13_weight"].dtype == torch.int32
        assert fresh[p + "w13_weight"].shape[-1] * 8 == 2 * MOE_I
        s13, s2 = fresh[p + "w13_weight_scale"], fresh[p + "w2_weight_scale"]
        assert s13.dtype == torch.int64 and s13.numel() == EXPERTS * 2 * MOE_I
        assert s2.dtype == torch.int64 and s2.numel() == EXPERTS * HIDDEN
        for e, (g, u, d) in enumerate(expert_weights(hf, i)):
            gu = torch.cat([int4.quantize_weight_w4a8(g, 0).scale, int4.quantize_weight_w4a8(u, 0).scale])
            assert torch.equal(s13.reshape(EXPERTS, -1)[e], _fp32_bits(gu)), (i, e)
            dq = int4.quantize_weight_w4a8(d, 0)
            assert torch.equal(s2.reshape(EXPERTS, -1)[e], _fp32_bits(dq.scale)), (i, e)
            packed = fresh[p + "w2_weight"][e]  # [I, H / 8]: the transposed int4 values
            assert torch.equal(int4.unpack_int4(packed), dq.q.t()), (i, e)


def test_every_sync_equals_a_fresh_per_channel_load_in_place(va, ckpts):
    (_, ms0, hf0, want0), (_, _, hf1, want1) = ckpts[0], ckpts[1]
    want = {0: want0, 1: want1}
    with policy(ms0) as v:
        m = v.model
        loader = m._npu_flashrl_loader
        assert {t.scheme.key for t in loader.experts.values()} == {("W4A8_DYNAMIC", "moe")}
        assert not loader.targets  # the other projections are FLOAT
        assert {int(t.layer.quant_method.quant_method.group_size) for t in loader.experts.values()} == {0}
        assert_equal_states(state(m), want[0])  # the cold load is vllm-ascend's own
        before = ptrs(m)
        expert_bytes = 3 * HIDDEN * MOE_I * 2  # gate + up + down of one expert, bf16
        for step, (seed, hf) in enumerate(((1, hf1), (0, hf0), (1, hf1))):
            buckets = random_buckets(trainer_weights(hf), seed=step, max_bytes=4 * expert_bytes)
            buffer = BucketBuffer(bucket_bytes(buckets))
            for bucket in buckets:
                buffer.deliver(m, bucket)
            assert va.end_weight_sync(m) == []
            post_sync(v)  # verl 0.9 runs post-processing after every sync: a no-op here
            assert_equal_states(state(m), want[seed])
            assert ptrs(m) == before, "a sync must write the experts in place"
            assert loader.staging_bytes() == 0


def test_a_nan_expert_is_refused_by_name_and_nothing_is_written(va, ckpts):
    from npu_flashrl.quant import WeightSyncError

    (_, ms0, _, want0), (_, _, hf1, _) = ckpts[0], ckpts[1]
    with policy(ms0) as v:
        bad = [(n, t.clone()) for n, t in trainer_weights(hf1)]
        name = "model.layers.0.mlp.experts.3.gate_proj.weight"
        i = next(k for k, (n, _) in enumerate(bad) if n == name)
        bad[i][1][1, 2] = float("inf")
        with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
            v.model.load_weights(bad)
        with pytest.raises(WeightSyncError, match="weight sync failed"):
            va.end_weight_sync(v.model)
        got = state(v.model)
        for n in want0:
            if ".mlp.experts." in n:
                assert torch.equal(got[n], want0[n]), f"{n}: written by a refused sync"


def test_an_entry_group_size_other_than_the_layers_is_refused_at_engine_build(va, ckpts):
    from npu_flashrl.quant import WeightSyncError

    with pytest.raises(WeightSyncError, match=r"model\.layers\.\d\.mlp\.experts: a vllm-ascend W4A8_DYNAMIC "
                                              r"fused-MoE layer built with group_size 0 \(per-channel\).*"
                                              r"says group_size 256"):
        with policy(ckpts[0][1], group_size=256):
            pass
    with policy(ckpts[0][1], group_size=0) as v:  # the checkpoint's own: accepted
        assert v.model._npu_flashrl_loader.quantizer.group_size == 0


def test_a_bare_bf16_checkpoint_with_group_size_0_is_refused_naming_the_key(va, ckpts):
    """A bare bf16 checkpoint's in-memory description types every projection W4A8_DYNAMIC, and
    vllm-ascend's W4A8 linear method divides by group_size: refused before it would."""
    with pytest.raises(Exception, match=r"group_size = 0 \(per-channel\) needs a ModelSlim W4A8 "
                                        r"checkpoint whose W4A8_DYNAMIC layers are all fused-MoE experts"):
        with policy(ckpts[0][0], group_size=0):
            pass


def test_setup_checks_accept_the_per_channel_checkpoint_and_refuse_w4a8_linear_layers(ckpts, tmp_path):
    """`setup` / `verify`'s checkpoint check (headers only): the per-channel MoE checkpoint passes;
    per-channel W4A8 linear layers, a bf16 checkpoint at group_size 0 and another entry group
    size are named."""
    import json
    import os
    import shutil

    from npu_flashrl.w4a8_checkpoint import w4a8_checkpoint_problems

    bf16, ms = ckpts[0][0], ckpts[0][1]
    assert w4a8_checkpoint_problems(ms) == []
    assert w4a8_checkpoint_problems(ms, group_size=0) == []
    (p,) = w4a8_checkpoint_problems(ms, group_size=256)
    assert "group_size 0, and the FlashRL config entry says group_size 256" in p
    (p,) = w4a8_checkpoint_problems(bf16, group_size=0)
    assert "group_size = 0 (per-channel) needs a ModelSlim W4A8 checkpoint" in p
    typed = str(tmp_path / "linear_typed")
    shutil.copytree(ms, typed)
    path = os.path.join(typed, "quant_model_description.json")
    with open(path) as f:
        desc = json.load(f)
    desc["model.layers.0.self_attn.o_proj.weight"] = "W4A8_DYNAMIC"
    with open(path, "w") as f:
        json.dump(desc, f)
    (p,) = w4a8_checkpoint_problems(typed)
    assert "group_size 0 (per-channel), and model.layers.0.self_attn.o_proj" in p
    assert "weight_scale_second as [out, in // group_size]" in p
