"""The per-channel form of W4A8_DYNAMIC's int4 math (`kernels.int4`, `group_size` 0: the form
vllm-ascend's W4A8 fused-MoE method loads when its description's group_size is 0): one fp32
scale per output channel, absmax / 7, values rounded half to even into [-8, 7], no second level.

Stand-ins: none (pure torch)."""
import pytest
import torch

from npu_flashrl.kernels import int4

pytestmark = pytest.mark.every_line


def _w(out=16, inp=64, seed=0, dtype=torch.bfloat16):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_per_channel_layout_scale_and_error():
    w = _w()
    q = int4.quantize_weight_w4a8(w, 0)
    assert q.group_size == 0 and q.scale_second is None
    assert q.q.dtype == torch.int8 and q.q.shape == (16, 64)
    assert q.scale.dtype == torch.float32 and torch.equal(q.scale, w.float().abs().amax(dim=1) / 7)
    # every row reaches +-7 at its absmax; nothing leaves [-8, 7]
    assert torch.equal(q.q.abs().amax(dim=1), torch.full((16,), 7, dtype=torch.int8))
    assert int(q.q.min()) >= -8
    # each value within half a step of the float weight
    assert bool(((q.dequantize() - w.float()).abs() <= q.scale.unsqueeze(1) / 2 * (1 + 1e-6)).all())
    # one scale for the whole row is coarser than the staged per-group form of the same weight
    err_pc = (q.dequantize() - w.float()).norm() / w.float().norm()
    err_g = (int4.quantize_weight_w4a8(w, 32).dequantize() - w.float()).norm() / w.float().norm()
    assert err_g < err_pc < 0.3


def test_per_channel_is_its_own_function_and_rounds_half_to_even():
    row = torch.tensor([[7.0, 2.5, 3.5, -2.5, 0.0, 1.0, -7.0, 0.5]])  # absmax 7 -> scale 1
    q = int4.quantize_weight_w4a8_per_channel(row)
    assert q.scale.tolist() == [1.0]
    assert q.q[0].tolist() == [7, 2, 4, -2, 0, 1, -7, 0]
    assert torch.equal(int4.quantize_weight_w4a8(row, 0).q, q.q)


def test_per_channel_takes_the_compute_dtype_first():
    w = _w(dtype=torch.float32, seed=3)
    a = int4.quantize_weight_w4a8(w, 0, compute_dtype=torch.bfloat16)
    b = int4.quantize_weight_w4a8(w.bfloat16(), 0)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


def test_a_zero_row_is_finite():
    w = torch.zeros(4, 32)
    w[2, 5] = -3.0
    q = int4.quantize_weight_w4a8(w, 0)
    assert torch.isfinite(q.scale).all() and q.scale[0] == 1.0
    assert torch.equal(q.dequantize(), w)


@pytest.mark.parametrize("bad,match", [
    (lambda: int4.quantize_weight_w4a8(_w()[0], 0), "must be 2-D"),
    (lambda: int4.quantize_weight_w4a8(torch.full((2, 32), float("inf")), 0), "NaN or Inf"),
    (lambda: int4.quantize_weight_w4a8(torch.zeros(2, 32, dtype=torch.int32), 0), "dtype"),
    (lambda: int4.quantize_weight_w4a8(_w(), False), "group_size must be a positive int"),
])
def test_per_channel_refusals_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
