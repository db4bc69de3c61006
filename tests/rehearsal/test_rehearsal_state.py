"""The tolerance rules of the rehearsal's INT8 state check (`npu_flashrl.rehearsal.state`), in process.

Stand-in: a minimal W8A8 layer (int8 weight in vllm-ascend's processed [in, out] layout, bf16
weight_scale, weight_offset, weight_scale_fp32, a dequantizing forward) instead of a vLLM model, so
one int8 value can be set exactly on or off a .5 tie. The whole check on the real vLLM / vllm-ascend
layers runs in tests/rehearsal/test_rehearsal.py and tests/rehearsal/test_rehearsal_checks.py.
"""
import types

import pytest
import torch

from npu_flashrl.kernels import reference
from npu_flashrl.rehearsal.state import NPU_MAX_TIE_FRACTION, Int8StateCheck

pytestmark = pytest.mark.every_line

NAME = "model.layers.0.self_attn.o_proj.weight"
PATH = "model.layers.0.self_attn.o_proj"
N = 64  # 64 x 64 = 4096 int8 values: one flip is 2.4e-4 of the layer, under NPU_MAX_TIE_FRACTION


class _W8A8(torch.nn.Module):
    def __init__(self, q, scale):
        super().__init__()
        self.weight = torch.nn.Parameter(q.t().contiguous(), requires_grad=False)  # processed [in, out]
        self.weight_scale = torch.nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)
        self.weight_offset = torch.nn.Parameter(torch.zeros(q.shape[0], dtype=torch.bfloat16), requires_grad=False)
        self.weight_scale_fp32 = self.weight_scale.data.float()

    def forward(self, x):
        return (x.float() @ (self.weight.float() * self.weight_scale.float())).to(x.dtype)


def _weights():
    """Row absmax 127 * 2^-7, so scale = 2^-7 exactly and w = 2.5 * 2^-7 quantizes at an exact tie."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(N, N, generator=g) * 0.2).clamp(-0.9, 0.9)
    w[:, 0] = 127 / 128
    w[0, 1] = 2.5 / 128  # quotient exactly 2.5: round half to even gives 2, half away from zero 3
    w[0, 2] = 2.3 / 128  # far from a tie
    w = w.to(torch.bfloat16)
    q, s = reference.quantize_weight_per_channel(w, torch.bfloat16)
    assert float(s[0]) == 2.0 ** -7 and int(q[0, 1]) == 2
    return w, q, s


def _check(q_live, scale, device, w):
    layer = _W8A8(q_live, scale)
    targets = {NAME: types.SimpleNamespace(path=PATH, layer=layer)}
    chk = Int8StateCheck(types.SimpleNamespace(packed_modules_mapping={}), targets, device)
    return chk.check({NAME: w}, step=1)[0], layer


def test_exact_state_passes_on_both_rules():
    w, q, s = _weights()
    for device in ("cpu", "npu"):
        res, _ = _check(q, s, device, w)
        assert not any(res["problems"].values()), res["problems"]
        assert res["int8_mismatches"] == 0 and res["scale_max_rel_diff"] == 0.0
        assert 0 < res["output_rel_error"] < 0.05


def test_one_step_at_a_tie_is_allowed_on_the_npu_only():
    w, q, s = _weights()
    bad = q.clone()
    bad[0, 1] = 3  # the NPU's half-away-from-zero answer at the exact tie
    res, _ = _check(bad, s, "npu", w)
    assert res["problems"]["int8"] is None and res["int8_mismatches"] == 1 and res["int8_mismatches_off_tie"] == 0
    res, _ = _check(bad, s, "cpu", w)
    assert "1/4096 int8 values differ" in res["problems"]["int8"]


def test_too_many_or_two_steps_fail_on_the_npu():
    w, q, s = _weights()
    off = q.clone()
    off[0, 2] += 1  # one step, not at a tie: within Huawei's int8 tolerance (|difference| <= 1)
    res, _ = _check(off, s, "npu", w)
    assert res["problems"]["int8"] is None and res["int8_mismatches_off_tie"] == 1
    res, _ = _check(off, s, "cpu", w)
    assert "1 not at a .5 tie" in res["problems"]["int8"]
    two = q.clone()
    two[0, 1] = 4  # two steps at the tie
    res, _ = _check(two, s, "npu", w)
    assert "max 2 steps" in res["problems"]["int8"]
    # more tie flips than NPU_MAX_TIE_FRACTION of the layer: the tie cells of several rows
    w2 = w.clone()
    rows = int(NPU_MAX_TIE_FRACTION * N * N) + 2
    w2[:rows, 1] = 2.5 / 128
    q2, s2 = reference.quantize_weight_per_channel(w2, torch.bfloat16)
    flipped = q2.clone()
    flipped[:rows, 1] = 3
    res, _ = _check(flipped, s2, "npu", w2)
    assert res["int8_mismatches_off_tie"] == 0 and f"{rows}/4096 int8 values differ" in res["problems"]["int8"]


def test_scale_derived_and_in_place_problems_are_named():
    w, q, s = _weights()
    res, layer = _check(q, s * 1.1, "cpu", w)
    assert "weight_scale off by up to" in res["problems"]["scale"]
    # derived copy and pointer: a layer whose fp32 copy went stale and whose weight was re-allocated
    layer = _W8A8(q, s)
    targets = {NAME: types.SimpleNamespace(path=PATH, layer=layer)}
    chk = Int8StateCheck(types.SimpleNamespace(packed_modules_mapping={}), targets, "cpu")
    # the old storage is freed here: the check still sees it (it keeps the cold-load tensors alive)
    layer.weight.data = layer.weight.data.clone()
    layer.weight_scale_fp32 += 1
    res = chk.check({NAME: w}, step=1)[0]
    assert "weight_scale_fp32 differs from weight_scale in 64/64 values" in res["problems"]["derived"]
    assert res["problems"]["in_place"] == "not written in place: weight data_ptr changed since the cold load"


def test_static_w8a8_deq_scale_and_quant_bias_are_recomputed_from_the_live_weight():
    """Static W8A8 (ModelSlim checkpoints): deq_scale = input_scale * weight_scale and quant_bias =
    round(bias / deq_scale) - input_offset * sum_k W_q must follow every sync."""
    w, q, s = _weights()
    layer = _W8A8(q, s)
    layer.input_scale = torch.nn.Parameter(torch.tensor([0.02], dtype=torch.bfloat16), requires_grad=False)
    layer.input_offset = torch.nn.Parameter(torch.tensor([3.0], dtype=torch.bfloat16), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, N, dtype=torch.bfloat16), requires_grad=False)
    deq = (layer.input_scale.float() * layer.weight_scale.float()).flatten()
    layer.deq_scale = torch.nn.Parameter(deq.clone(), requires_grad=False)
    wsum = q.to(torch.int64).sum(dim=1)  # sum over in of [out, in]
    qb = (torch.round(layer.bias.float() / deq).to(torch.int64) - 3 * wsum).to(torch.int32)
    layer.quant_bias = torch.nn.Parameter(qb.clone(), requires_grad=False)
    targets = {NAME: types.SimpleNamespace(path=PATH, layer=layer)}
    chk = Int8StateCheck(types.SimpleNamespace(packed_modules_mapping={}), targets, "cpu")
    res = chk.check({NAME: w}, step=1)[0]
    assert res["problems"]["derived"] is None, res["problems"]
    layer.quant_bias.data[5] += 1  # a bias fold that missed one channel
    layer.deq_scale.data[0] *= 1.01
    derived = chk.check({NAME: w}, step=2)[0]["problems"]["derived"]
    assert "deq_scale off input_scale * weight_scale by 0.01" in derived
    assert "quant_bias differs from round(bias / deq_scale) - input_offset * sum(W_q) in 1/64 values" in derived
