"""W4A8 MoE rollouts from a bare bf16 checkpoint (no ModelSlim W4A8 checkpoint): the entry's
quantizer types the in-memory description (`description_type` W4A8_DYNAMIC, `description_keys`
group_size 256), the cold load quantizes every expert projection as ModelSlim's W4A8 checkpoint
carries it (the MoE scheme's `checkpoint_items`) and equals a fresh load of that checkpoint bit
for bit; every later sync equals a fresh load of the synced weights, in place. And the same syncs
with verl 0.9's NPU `FusedMoE.weight_loader` wrapper in place (verl's own function installs it
after the engine was built, as importing `verl.utils.vllm` does on an NPU): its shape test
fires on this model's w2 (hidden == moe_intermediate) and would write the staged experts
transposed; the scheme stages through the layer's loader without it.

Real code: vLLM's Qwen3MoeForCausalLM and FusedMoE `weight_loader`, vllm-ascend's
AscendModelSlimConfig (fed the in-memory description), `AscendW4A8DynamicFusedMoEMethod` and
`AscendW4A8DynamicLinearMethod` (create_weights, post-processing), verl 0.9.1's
`_patch_legacy_fused_moe_weight_loader`. Stand-ins (named): torch_npu (the emulation:
`kernels.int4_moe`, `kernels.int4`), the mc2 group's HCCL name (`cpu_vllm._mc2_without_hccl`),
vLLM's CPU platform accepting "ascend", plain causal attention; the engine patch's
`EngineChoice` is written by the test as `vllm_engine._record_choice` writes it; the ModelSlim
checkpoints (the reference of a fresh load) are written by the tests' ModelSlim-format writer
with npu_flashrl's staged quantizer.
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import post_sync, ptrs, random_buckets, state
from npu_flashrl.sim.tiny_models import trainer_weights

from helpers import assert_equal_states, verl_npu_fused_moe
from w4a8_moe_models import GROUP, build_pair, require_w4a8_moe_reload

pytestmark = pytest.mark.every_line
W4A8_FN = "w4a8_profile_free"


@pytest.fixture(scope="module")
def ckpts(va, tmp_path_factory):
    """{seed: (bf16 dir, HF bf16 model, fresh load's state of its ModelSlim W4A8 twin)}."""
    from transformers import AutoModelForCausalLM

    require_w4a8_moe_reload()
    root = str(tmp_path_factory.mktemp("w4a8_moe_bf16"))
    out = {}
    for seed in (0, 1):
        bf16, ms = build_pair(root, seed)
        with cpu_vllm.CpuVllm(ms, quantization="ascend") as v:
            fresh = state(v.model)
        out[seed] = (bf16, AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16), fresh)
    return out


def policy(model_dir, group_size=None):
    from npu_flashrl.adapters.engine_choice import EngineChoice

    return cpu_vllm.CpuVllm(model_dir, quantization="ascend",
                            choice=EngineChoice(fn=W4A8_FN, group_size=group_size))


def _sync(va, v, hf, step):
    for bucket in random_buckets(trainer_weights(hf), seed=step, max_bytes=600_000):
        v.model.load_weights(bucket)
    assert va.end_weight_sync(v.model) == []
    post_sync(v)


@pytest.mark.parametrize("group_size", [None, GROUP])
def test_bare_bf16_cold_load_then_every_sync_equals_a_fresh_w4a8_moe_load(va, ckpts, group_size):
    (bf16_0, hf0, want0), (_, hf1, want1) = ckpts[0], ckpts[1]
    assert not os.path.exists(os.path.join(bf16_0, "quant_model_description.json"))
    want = {0: want0, 1: want1}
    with policy(bf16_0, group_size) as v:
        loader = v.model._npu_flashrl_loader
        assert {t.scheme.key for t in loader.experts.values()} == {("W4A8_DYNAMIC", "moe")}
        assert {int(t.layer.quant_method.quant_method.group_size) for t in loader.experts.values()} == {GROUP}
        assert_equal_states(state(v.model), want[0])  # the cold load: the ModelSlim load's state
        before = ptrs(v.model)
        for step, (seed, hf) in enumerate(((1, hf1), (0, hf0))):
            _sync(va, v, hf, step)
            assert_equal_states(state(v.model), want[seed])
            assert ptrs(v.model) == before
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4, 5]]))).all()


def test_syncs_are_right_with_verls_npu_fused_moe_loader_wrapper_in_place(va, ckpts, monkeypatch):
    FusedMoE, npu_patch = verl_npu_fused_moe(monkeypatch)  # the cold load without the wrapper
    (bf16_0, hf0, want0), (_, hf1, want1) = ckpts[0], ckpts[1]
    with policy(bf16_0) as v:
        assert_equal_states(state(v.model), want0)
        assert npu_patch._patch_legacy_fused_moe_weight_loader(FusedMoE)
        assert getattr(FusedMoE.weight_loader, "_verl_npu_weight_loader_patched", False)
        before = ptrs(v.model)
        for step, (seed, hf, want) in enumerate(((1, hf1, want1), (0, hf0, want0))):
            _sync(va, v, hf, step)
            assert_equal_states(state(v.model), want)
            assert ptrs(v.model) == before
