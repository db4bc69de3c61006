"""Host synchronisations of a sync delivered as verl delivers it (one `load_weights` list call
per bucket): the value checks of one call (NaN / Inf of float tensors, the INT8 wire's scales,
offsets and pairs) are read back together, one host synchronisation per bucket; each failure
still refuses by name, before anything of the call is written. A sync streamed as one generator
(the checkpoint engine's stream in benchmarks/sync.py, verl's sync mode, reload.py's calls)
reads its checks back twice whatever its layer count: before the sync's first write and at the
end of the call; a refusal found at the end still names the tensor, even when its sender has
refilled the buffer since, and leaves the model refusing to generate.

Counted with `npu_flashrl.sim.device_costs.DeviceCounter` (the NPU's units). Stand-ins:
torch_npu (emulated, `kernels/npu.py`'s mix on it), verl's bucket buffer (`sim.sync.BucketBuffer`),
a sender refilling one buffer for every item it yields (`_refilled`), vLLM attention (CPU)."""
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


def _refilled(weights):
    """A sender's stream yielding every tensor as a view of ONE byte buffer it refills (with NaN
    bytes after the last item): nothing a deferred check keeps may point into it."""
    buf = torch.empty(max(t.numel() * t.element_size() for _, t in weights), dtype=torch.uint8)
    for name, t in weights:
        view = buf[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        yield name, view
        buf.fill_(0xFF)


@pytest.mark.parametrize("wire", ["int8", "float"])
def test_a_streamed_sync_reads_its_checks_back_twice_whatever_its_layers(va, tmp_path, wire):
    """Before: every float tensor's NaN / Inf check, every projection's quantizer refusal and
    every INT8-wire scale and pair check read back on its own (82 host syncs for the 2-layer
    INT8-wire stream, 40 for the float one, growing with the layers). Now one read-back before
    the sync's first write and one at the end of the call, for 2 layers as for 4; the result
    equals the same sync as one list call."""
    syncs = {}
    for layers in (2, 4):
        over = {"num_hidden_layers": layers}
        cold = str(tmp_path / f"c{layers}")
        build_tiny_qwen2(cold, seed=0, tokenizer=False, config_overrides=over)
        hf = build_tiny_qwen2(str(tmp_path / f"w{layers}"), seed=1, tokenizer=False,
                              config_overrides=over)
        new = [(n, t.detach().clone()) for n, t in hf.state_dict().items()]
        sent = list(int8_wire(new, torch.bfloat16)) if wire == "int8" else new
        with build(va, cold) as v:
            with DeviceCounter() as c:
                v.model.load_weights(_refilled(sent))
                assert va.end_weight_sync(v.model) == []
            got = state(v.model)
        with build(va, cold) as v:
            v.model.load_weights(sent)
            va.end_weight_sync(v.model)
            want = state(v.model)
        assert [n for n in want if not torch.equal(got[n], want[n])] == []
        syncs[layers] = c.costs.host_syncs
    assert syncs[2] == syncs[4] <= 2, syncs


@pytest.mark.parametrize("what", ["norm_nan", "scale_inf", "scale_zero", "pair_overflow",
                                  "offset", "proj_nan"])
def test_a_bad_value_late_in_a_stream_is_refused_by_name_and_blocks_generation(va, dirs, what):
    """A stream's checks after its sync's first write are read back at its end: the refusal
    names the bad tensor although its sender refilled the buffer long before (the checks keep
    extremes, not tensors), and the model, holding weights of two syncs, refuses to generate
    until a complete sync."""
    (d0, _), (_, w1) = dirs
    sent = list(int8_wire(w1, torch.bfloat16)) if what != "proj_nan" else list(w1)
    name = {"norm_nan": "model.layers.1.input_layernorm.weight",
            "proj_nan": "model.layers.1.mlp.up_proj.weight",
            "offset": "model.layers.1.mlp.down_proj.weight_offset"}.get(
        what, "model.layers.1.mlp.down_proj.weight_scale")
    if what == "offset":  # a zero offset is accepted; a non-zero one is refused
        scale = dict(sent)["model.layers.1.mlp.down_proj.weight_scale"]
        sent.append((name, torch.ones_like(scale)))
    bad = dict(sent)[name].clone()
    if what in ("norm_nan", "proj_nan"):
        bad.view(-1)[5] = float("nan")
    elif what != "offset":
        bad[2] = {"scale_inf": float("inf"), "scale_zero": 0.0, "pair_overflow": 1e38}[what]
    match = {"scale_zero": f"{name}: scales must be > 0", "pair_overflow": f"{name}: row 2's scale",
             "offset": f"{name}: non-zero weight_offset"}.get(what, f"{name}: contains NaN or Inf")
    stream = [(n, bad if n == name else t) for n, t in sent]
    assert [n for n, _ in stream].index(name) > len(stream) // 2  # layer 0 is written before it
    with build(va, d0) as v:
        m = v.model
        with pytest.raises(WeightSyncError, match=match):
            m.load_weights(_refilled(stream))
        assert m._npu_flashrl_loader.inconsistent is not None
        with pytest.raises(WeightSyncError, match="refuses to generate"):
            va.end_weight_sync(m)
        m.load_weights(sent if what != "offset" else sent[:-1])
        assert va.end_weight_sync(m) == []
