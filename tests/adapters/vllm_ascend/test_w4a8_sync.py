"""W4A8 rollouts: a policy model of vllm-ascend's W4A8_DYNAMIC linear layers (on every line whose
vllm-ascend has the method: 0.23.0, 0.11.0 and v0.10.1rc1 all do; cold-loaded
from a ModelSlim W4A8 checkpoint, group size 32) takes the trainer's bf16 weights at every sync,
and after every sync equals a fresh W4A8 load of the same weights bit for bit (the packed int4
weight, both scale levels and everything post-processing derives), with every data pointer
unchanged; bucketed, in any split; refused or complete.

Real code: vLLM's model and loaders, vllm-ascend's `AscendModelSlimConfig`, its
`AscendW4A8DynamicLinearMethod` (its weight loaders, post-processing and `process_scale_second`),
vLLM's `process_weights_after_loading` as verl 0.9 runs it after every sync. Stand-ins (named):
torch_npu (the emulation: `kernels.int4` for the int4 ops, `Tensor.npu()` the identity), vLLM's
CPU platform accepting "ascend", plain causal attention (npu_flashrl.sim.cpu_vllm); the
checkpoints are written by the test's ModelSlim-format writer with npu_flashrl's staged quantizer
(ModelSlim's own is compiled and needs a calibration run).
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import post_sync, ptrs, random_buckets, state

from helpers import assert_equal_states, fresh_w4a8_state, hf_weights

pytestmark = pytest.mark.every_line
GROUP = 32
W4A8_FN = "w4a8_profile_free"


@pytest.fixture(scope="module")
def ckpts(va, tmp_path_factory):
    """{seed: (bf16 dir, ModelSlim W4A8 dir, HF bf16 model)} for two weight sets of one shape."""
    from modelslim_writer import w4a8_checkpoint_pairs

    return w4a8_checkpoint_pairs(tmp_path_factory, GROUP, "w4a8")


def policy(ms_dir, fn=W4A8_FN):
    return cpu_vllm.CpuVllm(ms_dir, quantization="ascend", choice=cpu_vllm.int8(fn))


def test_every_sync_equals_a_fresh_w4a8_load_in_place(ckpts):
    from npu_flashrl.adapters.vllm_ascend import end_weight_sync

    (_, ms0, hf0), (_, ms1, hf1) = ckpts[0], ckpts[1]
    want = {0: fresh_w4a8_state(ms0), 1: fresh_w4a8_state(ms1)}
    with policy(ms0) as v:
        loader = v.model._npu_flashrl_loader
        assert {t.scheme.key for t in loader.targets.values()} == {("W4A8_DYNAMIC", "linear")}
        assert_equal_states(state(v.model), want[0])  # the cold load is vllm-ascend's own
        before = ptrs(v.model)
        for step, (seed, hf) in enumerate(((1, hf1), (0, hf0), (1, hf1))):
            for bucket in random_buckets(hf_weights(hf), seed=step, max_bytes=200_000):
                v.model.load_weights(bucket)
            assert end_weight_sync(v.model) == []
            post_sync(v)  # verl 0.9 runs post-processing after every sync: a no-op here
            assert_equal_states(state(v.model), want[seed])
            assert ptrs(v.model) == before
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4, 5]]))).all()


def test_a_refused_sync_leaves_the_w4a8_layers_as_they_were(ckpts):
    """A NaN in one projection of a list call: nothing of the call is written (list calls are
    checked whole); streamed, the layer it belongs to keeps its weights (its staging is dropped),
    and the end of the sync names what failed."""
    from npu_flashrl.adapters.vllm_ascend import end_weight_sync
    from npu_flashrl.quant import WeightSyncError

    (_, ms0, _), (_, _, hf1) = ckpts[0], ckpts[1]
    with policy(ms0) as v:
        before = state(v.model)
        bad = hf_weights(hf1)
        i = next(k for k, (n, _) in enumerate(bad) if n.endswith("layers.1.self_attn.k_proj.weight"))
        bad[i][1][0, 3] = float("nan")
        with pytest.raises(WeightSyncError, match="k_proj.weight"):
            v.model.load_weights(bad)
        with pytest.raises(WeightSyncError, match="weight sync failed"):
            end_weight_sync(v.model)
        assert_equal_states(state(v.model), before)


def test_int8_fn_on_w4a8_layers_is_refused_at_engine_build(ckpts):
    from npu_flashrl.quant import WeightSyncError

    with pytest.raises(WeightSyncError, match=r"qkv_proj: a vllm-ascend W4A8_DYNAMIC layer, and fn "
                                              r"'int8_profile_free' quantizes for W8A8_DYNAMIC/W8A8 "
                                              r"layers only"):
        with policy(ckpts[0][1], fn="int8_profile_free"):
            pass


def test_w4a8_fn_on_w8a8_layers_is_refused_at_engine_build(va, tmp_path):
    from npu_flashrl.quant import WeightSyncError
    from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

    _, w8 = tiny_checkpoint_pair(str(tmp_path))
    # (W8A8_DYNAMIC layers are served only beside W4A8 ones: a ModelSlim mixed checkpoint)
    with pytest.raises(WeightSyncError, match=r"W8A8_DYNAMIC layer, and no layer of the model is "
                                              r"W4A8_DYNAMIC: fn 'w4a8_profile_free' serves W8A8_DYNAMIC "
                                              r"layers only beside its own"):
        with policy(w8):
            pass


def test_cold_load_of_bf16_weights_under_a_w4a8_description(ckpts, tmp_path):
    """A bf16 checkpoint with a ModelSlim W4A8_DYNAMIC description (the projections typed
    W4A8_DYNAMIC, group_size 32): the cold load quantizes each float projection into what the
    scheme's checkpoint carries (`checkpoint_items`: int4 values, both scale levels and their
    zero offsets) and equals a fresh load of the ModelSlim checkpoint of the same weights."""
    import json
    import shutil

    bf16, ms, _ = ckpts[0]
    mixed = str(tmp_path / "bf16_w4a8_description")
    shutil.copytree(bf16, mixed)
    with open(os.path.join(ms, "quant_model_description.json")) as f:
        desc = json.load(f)
    with open(os.path.join(mixed, "quant_model_description.json"), "w") as f:
        json.dump({k: v for k, v in desc.items() if not k.endswith(("_scale", "_offset", "_second"))}, f)
    want = fresh_w4a8_state(ms)
    with policy(mixed) as v:
        assert_equal_states(state(v.model), want)
