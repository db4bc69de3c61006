"""W4A8_DYNAMIC's int4 math (`npu_flashrl.kernels.int4`): the staged ModelSlim quantizer that
defines the semantics, the int4 packing, and the two emulated torch_npu ops vllm-ascend's W4A8
linear layers call, refusing what their pages refuse (`kernels/op_rules.py`).

Stand-in: the emulated torch_npu (the subject here: no NPU in CI)."""
import pytest
import torch

from npu_flashrl.kernels import int4, op_rules

from helpers import emulated_torch_npu

pytestmark = pytest.mark.every_line


def _w(out=16, inp=64, seed=0, dtype=torch.bfloat16):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_staged_quantizer_layout_and_error():
    w = _w()
    q = int4.quantize_weight_w4a8(w, group_size=32)
    assert q.q.dtype == torch.int8 and q.q.shape == (16, 64)
    assert int(q.q.min()) >= -8 and int(q.q.max()) <= 7
    assert q.scale.shape == (16,) and q.scale.dtype == torch.float32
    assert q.scale_second.shape == (16, 2) and q.scale_second.dtype == torch.float32
    # stage 1 is per-channel int8 of the bf16 weight: absmax / 127
    assert torch.equal(q.scale, w.float().abs().amax(dim=1) / 127)
    # every group reaches the int4 extreme it is scaled to
    assert torch.equal(q.q.abs().reshape(16, 2, 32).amax(dim=2), torch.full((16, 2), 7, dtype=torch.int8))
    err = (q.dequantize() - w.float()).norm() / w.float().norm()
    assert 0.01 < err < 0.15  # int4: coarser than INT8's ~1%, far from garbage


def test_group_layout_is_consecutive_input_columns():
    """A change inside group 1 of row 3 (columns 32..63) moves only that group's second-level
    scale (the first-level scale and the other groups stay as they were)."""
    w = _w(dtype=torch.float32)
    w[3, 0] = 10.0  # row 3's absmax sits in group 0
    a = int4.quantize_weight_w4a8(w, 32)
    w2 = w.clone()
    w2[3, 32:] *= 0.5
    b = int4.quantize_weight_w4a8(w2, 32)
    assert torch.equal(a.scale, b.scale)
    changed = (a.scale_second != b.scale_second).nonzero().tolist()
    assert changed == [[3, 1]]


def test_rounding_is_half_to_even():
    """A group whose int8 values divide to .5 ties rounds them to even (2.5 -> 2, 3.5 -> 4)."""
    # row absmax 127 -> scale 1 (w8 = w); group max 14 -> scale_second 2; 5/2=2.5, 7/2=3.5
    row = torch.zeros(1, 8)
    row[0, :4] = torch.tensor([127.0, 0.0, 0.0, 0.0])
    row[0, 4:] = torch.tensor([14.0, 5.0, 7.0, -5.0])
    q = int4.quantize_weight_w4a8(row, group_size=4)
    assert q.scale[0] == 1.0 and q.scale_second[0, 1] == 2.0
    assert q.q[0, 4:].tolist() == [7, 2, 4, -2]


def test_zero_rows_and_groups_are_finite():
    w = torch.zeros(8, 64)
    w[1, :32] = 1.0
    q = int4.quantize_weight_w4a8(w, 32)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.scale_second).all()
    assert torch.equal(q.dequantize(), w)


@pytest.mark.parametrize("bad,match", [
    (lambda: int4.quantize_weight_w4a8(_w(), 24), "group_size=24 must divide the input size 64"),
    (lambda: int4.quantize_weight_w4a8(_w(), -4), "group_size must be a positive int"),  # 0: per-channel
    (lambda: int4.quantize_weight_w4a8(_w()[0], 32), "must be 2-D"),
    (lambda: int4.quantize_weight_w4a8(torch.full((2, 32), float("nan")), 32), "NaN or Inf"),
    (lambda: int4.quantize_weight_w4a8(torch.zeros(2, 32, dtype=torch.int8), 32), "dtype"),
])
def test_quantizer_refusals_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_pack_order_and_round_trip():
    v = torch.tensor([[1, -1, 2, -8, 7, 0, 3, -4]], dtype=torch.int32)
    packed = int4.pack_int4(v)
    assert packed.shape == (1, 1) and packed.dtype == torch.int32
    word = int(packed[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [1, 15, 2, 8, 7, 0, 3, 12]
    r = torch.randint(-8, 8, (33, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    assert torch.equal(int4.unpack_int4(int4.pack_int4(r)), r.to(torch.int8))


@pytest.fixture
def torch_npu():
    with emulated_torch_npu() as mod:
        yield mod


def test_emulated_ops_are_the_int4_kernels(torch_npu):
    assert torch_npu.npu_convert_weight_to_int4pack is int4.npu_convert_weight_to_int4pack
    assert torch_npu.npu_weight_quant_batchmatmul is int4.npu_weight_quant_batchmatmul
    t = torch.ones(2)
    assert t.npu() is t  # the emulated machine's NPU is the CPU


@pytest.mark.parametrize("weight,match", [
    (torch.full((4, 8), 8, dtype=torch.int32), r"\[-8, 7\]"),
    (torch.zeros(4, 12, dtype=torch.int32), "multiple of 8"),
    (torch.zeros(4, 8, dtype=torch.int8), "dtype must be one of int32"),
    (torch.zeros(16, 8, dtype=torch.int32).t(), "contiguous"),
    (torch.zeros(2, 4, 8, dtype=torch.int32), "2-D"),
])
def test_int4pack_refuses_what_its_page_refuses(torch_npu, weight, match):
    with pytest.raises(op_rules.OpRuleError, match=match) as e:
        torch_npu.npu_convert_weight_to_int4pack(weight)
    assert "npu_convert_weight_to_int4pack" in str(e.value) and "hiascend.com" in str(e.value)


def test_weight_quant_matmul_per_group_is_the_w4a8_layer_math(torch_npu):
    """What vllm-ascend's W4A8 `apply` computes, from the packed [in, out/8] weight and the
    [in/group, out] antiquant scale: x @ (scale * scale_second * q)^T."""
    w = _w(out=24, inp=64, seed=3)
    q = int4.quantize_weight_w4a8(w, 32)
    packed = torch_npu.npu_convert_weight_to_int4pack(q.q.t().contiguous().to(torch.int32))
    assert packed.shape == (64, 3)
    antiquant = (q.scale.unsqueeze(1) * q.scale_second).t().contiguous()  # [groups, out]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = torch_npu.npu_weight_quant_batchmatmul(x, packed, antiquant_scale=antiquant.bfloat16(),
                                               antiquant_group_size=32)
    ref = x.double() @ q.dequantize().double().t()
    assert y.dtype == torch.bfloat16
    assert (y.double() - ref).norm() / ref.norm() < 0.01


@pytest.mark.parametrize("change,match", [
    (dict(antiquant_scale=torch.ones(2, 24).half()), "dtype must equal x's"),
    (dict(antiquant_scale=torch.ones(3, 24).bfloat16()), r"ceil_div\(K, antiquant_group_size\)"),
    (dict(x=torch.ones(5, 64)), "x: dtype must be one of float16, bfloat16"),
    (dict(x=torch.ones(5, 32).bfloat16()), "must equal x's K"),
])
def test_weight_quant_matmul_refusals(torch_npu, change, match):
    args = dict(x=torch.ones(5, 64).bfloat16(), weight=torch.zeros(64, 3, dtype=torch.int32),
                antiquant_scale=torch.ones(2, 24).bfloat16())
    args.update(change)
    with pytest.raises(op_rules.OpRuleError, match=match):
        torch_npu.npu_weight_quant_batchmatmul(args["x"], args["weight"], args["antiquant_scale"],
                                               antiquant_group_size=32)
