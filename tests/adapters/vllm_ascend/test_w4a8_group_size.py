"""W4A8 rollouts from a bare bf16 checkpoint: the FlashRL config entry's `group_size` reaches the
in-memory quant description the engine reads (the layers are built with it) and the quantizer;
the cold load quantizes into vllm-ascend's W4A8_DYNAMIC layers and every later sync equals a
fresh load of a ModelSlim W4A8 checkpoint of the same weights and group size, bit for bit, in
place. A group size that does not divide a layer's input dim, or that differs from a ModelSlim
checkpoint's own, is refused at engine build naming the layer.

Real code: vLLM's model and loaders, vllm-ascend's `AscendModelSlimConfig` and
`AscendW4A8DynamicLinearMethod` (its weight loaders, post-processing and scale folding), vLLM's
`process_weights_after_loading` as verl 0.9 runs it after every sync. Stand-ins (named):
torch_npu (the emulation: `kernels.int4` for the int4 ops, `Tensor.npu()` the identity), vLLM's
CPU platform accepting "ascend", plain causal attention (npu_flashrl.sim.cpu_vllm); the engine
patch's `EngineChoice` is written by the test as `vllm_engine._record_choice` writes it; the
ModelSlim checkpoints (the reference of a "fresh load") are written by the test's ModelSlim-format
writer with npu_flashrl's staged quantizer (ModelSlim's own is compiled and needs a calibration
run). The tiny Qwen2 has input dims 128 (hidden) and 352 (intermediate).
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import post_sync, ptrs, random_buckets, state

from helpers import assert_equal_states, fresh_w4a8_state, hf_weights

pytestmark = pytest.mark.every_line
W4A8_FN = "w4a8_profile_free"
GROUP = 16  # not the ModelSlim writer's 32 of the other W4A8 tests, and not the default 256


@pytest.fixture(scope="module")
def ckpts(va, tmp_path_factory):
    """{seed: (bf16 dir, ModelSlim W4A8 dir of group GROUP, HF bf16 model)}."""
    from modelslim_writer import w4a8_checkpoint_pairs

    return w4a8_checkpoint_pairs(tmp_path_factory, GROUP, "w4a8_gs")


def policy(model_dir, group_size=None):
    from npu_flashrl.adapters.engine_choice import EngineChoice

    return cpu_vllm.CpuVllm(model_dir, quantization="ascend",
                            choice=EngineChoice(fn=W4A8_FN, group_size=group_size))


def test_bare_bf16_cold_load_then_every_sync_equals_a_fresh_w4a8_load(ckpts):
    from npu_flashrl.adapters.vllm_ascend import end_weight_sync
    from npu_flashrl.adapters.vllm_ascend.schemes.w4a8_dynamic import group_size_of

    (bf16_0, ms0, hf0), (_, ms1, hf1) = ckpts[0], ckpts[1]
    assert not os.path.exists(os.path.join(bf16_0, "quant_model_description.json"))
    want = {0: fresh_w4a8_state(ms0), 1: fresh_w4a8_state(ms1)}
    with policy(bf16_0, group_size=GROUP) as v:
        loader = v.model._npu_flashrl_loader
        assert {t.scheme.key for t in loader.targets.values()} == {("W4A8_DYNAMIC", "linear")}
        assert {group_size_of(t.layer) for t in loader.targets.values()} == {GROUP}
        assert loader.quantizer.group_size == GROUP
        assert_equal_states(state(v.model), want[0])  # the cold load: the ModelSlim load's state
        before = ptrs(v.model)
        for step, (seed, hf) in enumerate(((1, hf1), (0, hf0))):
            for bucket in random_buckets(hf_weights(hf), seed=step, max_bytes=200_000):
                v.model.load_weights(bucket)
            assert end_weight_sync(v.model) == []
            post_sync(v)
            assert_equal_states(state(v.model), want[seed])
            assert ptrs(v.model) == before
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4, 5]]))).all()


def test_the_default_group_size_that_does_not_divide_an_in_dim_is_refused_naming_the_layer(ckpts):
    from npu_flashrl.quant import WeightSyncError

    # no group_size key: vllm-ascend's default 256, which divides neither 128 nor 352
    with pytest.raises(WeightSyncError, match=r"model\.layers\.0\.self_attn\.qkv_proj: input dim 128 "
                                              r"is not a multiple of group_size 256"):
        with policy(ckpts[0][0]):
            pass


def test_a_config_group_size_other_than_the_modelslim_checkpoints_is_refused(ckpts):
    from npu_flashrl.quant import WeightSyncError

    ms = ckpts[0][1]
    with pytest.raises(WeightSyncError, match=rf"qkv_proj: a vllm-ascend W4A8_DYNAMIC layer built with "
                                              rf"group_size {GROUP} .* says group_size 32"):
        with policy(ms, group_size=32):
            pass
    with policy(ms, group_size=GROUP) as v:  # the checkpoint's own: accepted
        assert v.model._npu_flashrl_loader.quantizer.group_size == GROUP
