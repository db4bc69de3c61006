"""Host synchronisations of a sync delivered as verl delivers it (one `load_weights` list call
per bucket): the value checks of one call (NaN / Inf of float tensors, the INT8 wire's scales,
offsets and pairs) are read back together, one host synchronisation per bucket; each failure
still refuses by name, before anything of the call is written.

Counted with `npu_flashrl.sim.device_costs.DeviceCounter` (the NPU's units). Stand-ins:
torch_npu (emulated, `kernels/npu.py`'s mix on it), verl's bucket buffer (`sim.sync.BucketBuffer`),
vLLM attention (CPU)."""
import os

import pytest
import torch

from helpers import build
from npu_flashrl.quant import WeightSyncError
from npu_flashrl.quant.wire import int8_wire
from npu_flashrl.sim.device_costs import DeviceCounter
from npu_flashrl.sim.sync import BucketBuffer, split_buckets, state
from npu_flashrl.sim.tiny_models import build_tiny_qwen2

pytestmark = pytest.mark.every_line


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("host_syncs")
    out = []
    for seed in (0, 1):
        d = os.path.join(root, f"w{seed}")
        model = build_tiny_qwen2(d, seed=seed, tokenizer=False)
        out.append((d, [(n, t.detach().clone()) for n, t in model.state_dict().items()]))
    return out


def _sync(va, m, weights, bucket_bytes=64 << 10):
    buckets = split_buckets(weights, bucket_bytes)
    buffer = BucketBuffer(1 << 20)
    with DeviceCounter() as c:
        for b in buckets:
            buffer.deliver(m, b)
        va.end_weight_sync(m)
    return c.costs, len(buckets)


def test_int8_wire_buckets_make_one_host_sync_each(va, dirs):
    (d0, _), (_, w1) = dirs
    wire = list(int8_wire(w1, torch.bfloat16))
    with build(va, d0) as v:
        costs, buckets = _sync(va, v.model, wire)
    assert buckets > 2 and costs.host_syncs <= buckets, (costs.host_syncs, buckets)


def test_float_buckets_make_one_host_sync_each(va, dirs):
    """The float path: the call's float checks and the quantizer's NaN / Inf refusal of every
    projection (`kernels/npu.py`'s scale check, handed back as a device flag) read back together;
    the layers the bucket completes are committed after that. No separate value pass over the
    projections."""
    (d0, _), (_, w1) = dirs
    with build(va, d0) as v:
        costs, buckets = _sync(va, v.model, w1)
    assert buckets > 2 and costs.host_syncs <= buckets, (costs.host_syncs, buckets)
    assert "aminmax" not in costs.by_op or costs.by_op["aminmax"] <= 13  # floats only, no projection


@pytest.mark.parametrize("what", ["norm_nan", "scale_inf", "scale_zero", "pair_overflow", "proj_nan"])
def test_a_bad_value_in_a_bucket_is_still_refused_by_name_before_any_write(va, dirs, what):
    (d0, _), (_, w1) = dirs
    wire = dict(int8_wire(w1, torch.bfloat16)) if what != "proj_nan" else dict(w1)
    scale = "model.layers.0.mlp.down_proj.weight_scale"
    if what == "norm_nan":
        name = "model.layers.0.input_layernorm.weight"
        wire[name] = wire[name].clone()
        wire[name][3] = float("nan")
        match = f"{name}: contains NaN or Inf"
    elif what == "proj_nan":  # a float bucket completing layer 0's MLP: gate, up and down
        name = "model.layers.0.mlp.up_proj.weight"
        wire[name] = wire[name].clone()
        wire[name][1, 2] = float("nan")
        match = f"{name}: quantize_weight_per_channel: weight contains NaN or Inf"
    else:
        name = scale
        wire[name] = wire[name].clone()
        wire[name][2] = {"scale_inf": float("inf"), "scale_zero": 0.0, "pair_overflow": 1e38}[what]
        match = {"scale_inf": f"{name}: contains NaN or Inf", "scale_zero": f"{name}: scales must be > 0",
                 "pair_overflow": f"{name}: row 2's scale"}[what]
    weight = "model.layers.0.mlp.down_proj.weight"
    names = ("model.layers.0.input_layernorm.weight", scale, weight) if what != "proj_nan" else (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", weight)
    bucket = [(n, wire[n]) for n in names]
    with build(va, d0) as v:
        m = v.model
        before = state(m)
        with pytest.raises(WeightSyncError, match=match), DeviceCounter():
            m.load_weights(bucket)
        after = state(m)
        assert all(torch.equal(before[k], after[k]) for k in before)
