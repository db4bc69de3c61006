"""Reference INT8 kernels against hand-computed values and torch_npu's documented semantics.

Every expected value here is worked out by hand in the comments (or derived from the exact
bit patterns of the inputs), never copied from the code's output.
"""
import logging
import struct

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.kernels import reference as ref


def _t(values, dtype):
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------- npu_dynamic_quant

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dynamic_quant_documented_example(dtype):
    # torch_npu docs: [0.7261, 0.3726, 0.9126] -> [101, 52, 127].
    # fp16: 0.7261/0.9126*127 = 101.04, 0.3726/0.9126*127 = 51.85.
    # bf16 rounds the inputs to 0.7265625, 0.3730469, 0.9140625: 100.95 -> 101, 51.83 -> 52.
    x = _t([[0.7261, 0.3726, 0.9126]], dtype)
    y, scale = ref.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32
    assert y.tolist() == [[101, 52, 127]]
    assert scale.shape == (1,)
    # scale = rowmax|x| / 127, with x the value actually stored in `dtype`.
    stored_max = {torch.float16: 0.912597656250, torch.bfloat16: 0.9140625}[dtype]
    assert scale.item() == pytest.approx(stored_max / 127, rel=1e-6)


def test_dynamic_quant_dst_type_keyword():
    # vllm-ascend 0.23 calls npu_dynamic_quant(x, dst_type=torch.int8): same result as the
    # default; other output types (int4, fp8) are not emulated and say so.
    x = _t([[0.7261, 0.3726, 0.9126]], torch.float16)
    y, scale = ref.npu_dynamic_quant(x, dst_type=torch.int8)
    y0, scale0 = ref.npu_dynamic_quant(x)
    assert torch.equal(y, y0) and torch.equal(scale, scale0)
    with pytest.raises(NotImplementedError, match="dst_type"):
        ref.npu_dynamic_quant(x, dst_type=torch.quint4x2)


def test_dynamic_quant_per_token_rows_and_leading_dims():
    # Two tokens in a [1, 2, 4] batch (values exact in bf16); each row has its own scale.
    x = _t([[[127.0, -63.5, 2.5, 0.5], [-8.0, 4.0, 1.0, -3.0]]], torch.bfloat16)
    y, scale = ref.npu_dynamic_quant(x)
    assert scale.shape == (1, 2)
    # row 0: scale 1 -> [127, -63.5->-64 (even), 2.5->2 (even), 0.5->0 (even)]
    # row 1: scale 8/127 -> [-127, 63.5, 15.875, -47.625] -> [-127, 63.5+-eps, 16, -48]
    assert y[0, 0].tolist() == [127, -64, 2, 0]
    assert y[0, 1].tolist()[0] == -127 and y[0, 1].tolist()[2:] == [16, -48]
    assert y[0, 1, 1].item() in (63, 64)  # 4/(8/127) = 63.5 up to fp32 rounding of 8/127
    assert scale[0, 0].item() == pytest.approx(1.0, rel=1e-6)
    assert scale[0, 1].item() == pytest.approx(8.0 / 127, rel=1e-6)


def test_dynamic_quant_smooth_scales():
    # x * smooth = [1*2, 3*0.5, -127*1] = [2, 1.5, -127]; absmax 127 -> scale 1 -> [2, 2, -127]
    x = _t([[1.0, 3.0, -127.0]], torch.float16)
    y, scale = ref.npu_dynamic_quant(x, smooth_scales=_t([2.0, 0.5, 1.0], torch.float16))
    assert y.tolist() == [[2, 2, -127]]
    assert scale.item() == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dynamic_quant_zero_row_is_finite(dtype):
    x = _t([[0.0, 0.0, 0.0], [0.0, -1.27, 2.54]], dtype)
    y, scale = ref.npu_dynamic_quant(x)
    assert torch.isfinite(scale).all()
    assert y[0].tolist() == [0, 0, 0]
    assert y[1].tolist() == [0, -64, 127] or y[1].tolist() == [0, -63, 127]
    # Dequantized zero row stays exactly zero (no 0/0 anywhere).
    deq = y.float() * scale.unsqueeze(-1)
    assert not torch.isnan(deq).any()
    assert deq[0].tolist() == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- npu_quantize

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_rounds_half_to_even(dtype):
    x = _t([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49, 0.51], dtype)
    q = ref.npu_quantize(x, _t([1.0], torch.float32), None, torch.qint8, axis=-1)
    assert q.dtype == torch.int8
    assert q.tolist() == [0, 2, 2, 4, 0, -2, -2, 0, 1]


def test_quantize_saturates():
    # 127.5 rounds (half to even) to 128 -> saturated to 127; -128.5 rounds to -128 (even).
    x = _t([200.0, -200.0, 127.4, 127.5, -128.5, -129.0, 1e9, -1e9], torch.float32)
    q = ref.npu_quantize(x, _t([1.0], torch.float32), None, torch.qint8, axis=-1)
    assert q.tolist() == [127, -128, 127, 127, -128, -128, 127, -128]


def test_quantize_quint8_range():
    x = _t([-5.0, 0.4, 254.5, 300.0], torch.float32)
    q = ref.npu_quantize(x, _t([1.0], torch.float32), None, torch.quint8, axis=-1)
    assert q.dtype == torch.uint8
    assert q.tolist() == [0, 0, 254, 255]  # 254.5 -> 254 (even)


def test_quantize_div_mode_both_ways():
    x = _t([3.0, -6.0, 1.0], torch.float32)
    s = _t([2.0], torch.float32)
    # div_mode True: x / 2 = [1.5, -3, 0.5] -> [2, -3, 0]
    assert ref.npu_quantize(x, s, None, torch.qint8, -1, True).tolist() == [2, -3, 0]
    # div_mode False: x * 2 = [6, -12, 2]
    assert ref.npu_quantize(x, s, None, torch.qint8, -1, False).tolist() == [6, -12, 2]


def test_quantize_zero_points():
    x = _t([3.0, -6.0, 250.0, -300.0], torch.float32)
    s = _t([2.0], torch.float32)
    zp = _t([3], torch.int8)
    # x/2 + 3 = [4.5, 0, 128, -147] -> [4 (even), 0, 127 (sat), -128 (sat)]
    assert ref.npu_quantize(x, s, zp, torch.qint8, -1, True).tolist() == [4, 0, 127, -128]
    # Zero point added after rounding would give 1.5->2, +3 = 5: this checks it is added before.
    # x*2 + 3 = [9, -9, 503, -597] (div_mode False: zero_points of scales' dtype and shape)
    zpf = _t([3.0], torch.float32)
    assert ref.npu_quantize(x, s, zpf, torch.qint8, -1, False).tolist() == [9, -9, 127, -128]


def test_quantize_per_axis_scales_and_zero_points():
    x = _t([[4.0, 4.0, 4.0], [8.0, -8.0, 8.0]], torch.float32)
    # axis 1 (default), scales per column [1, 2, 4]
    q1 = ref.npu_quantize(x, _t([1.0, 2.0, 4.0], torch.float32), None, torch.qint8)
    assert q1.tolist() == [[4, 2, 1], [8, -4, 2]]
    # axis -1 means the same here
    q1b = ref.npu_quantize(x, _t([1.0, 2.0, 4.0], torch.float32), None, torch.qint8, axis=-1)
    assert q1b.tolist() == [[4, 2, 1], [8, -4, 2]]
    # axis 0, scales per row [1, 2], per-row zero points [0, -1]
    q0 = ref.npu_quantize(x, _t([1.0, 2.0], torch.float32), _t([0, -1], torch.int8),
                          torch.qint8, axis=0)
    assert q0.tolist() == [[4, 4, 4], [3, -5, 3]]
    # multiplicative per-axis scales (what vllm-ascend's static W8A8 uses: axis -1, div False)
    qm = ref.npu_quantize(x, _t([0.5, 0.25, 1.0], torch.float32), None, torch.qint8, -1, False)
    assert qm.tolist() == [[2, 1, 4], [4, -2, 8]]


def test_quantize_rejects_mismatched_scales():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="scales"):
        ref.npu_quantize(x, torch.ones(2), None, torch.qint8, axis=1)
    with pytest.raises(ValueError, match="zero_points"):
        ref.npu_quantize(x, torch.ones(3), torch.zeros(4, dtype=torch.int8), torch.qint8, axis=1)
    with pytest.raises(ValueError, match="input: dtype"):
        ref.npu_quantize(torch.zeros(2, 3, dtype=torch.int32), torch.ones(1), None, torch.qint8)


# --------------------------------------------------------------------------- weight quantization

# Rows chosen so the scale is exact in fp32 and every value is exact in bf16/fp16/fp32:
#   row 0: absmax 127 -> scale 1:   [127, -64.5, 10.5, 0.25] -> [127, -64, 10, 0]
#   row 1: absmax 254 -> scale 2:   [-254, 3, 5, 1] / 2 = [-127, 1.5, 2.5, 0.5] -> [-127, 2, 2, 0]
#   row 2: all zero   -> scale 1.0 (safe), q = 0
#   row 3: absmax 63.5 -> scale 0.5: [63.5, -1.25, 0.75, 20] / 0.5 = [127, -2.5, 1.5, 40]
#                                   -> [127, -2, 2, 40]
_W = [[127.0, -64.5, 10.5, 0.25],
      [-254.0, 3.0, 5.0, 1.0],
      [0.0, 0.0, 0.0, 0.0],
      [63.5, -1.25, 0.75, 20.0]]
_Q = [[127, -64, 10, 0], [-127, 2, 2, 0], [0, 0, 0, 0], [127, -2, 2, 40]]
_S = [1.0, 2.0, 1.0, 0.5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("impl", [ref.quantize_weight_per_channel, kernels.quantize_weight_per_channel],
                         ids=["reference", "dispatch"])
def test_per_channel_hand_computed(dtype, impl):
    q, s = impl(_t(_W, dtype))
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.tolist() == _Q
    assert s.tolist() == _S
    assert torch.isfinite(s).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_channel_random_properties(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g) * 3).to(dtype)
    q, s = ref.quantize_weight_per_channel(w)
    wf = w.float()
    # scale is absmax/127 per output row; each row hits +-127 exactly once at its absmax
    assert torch.allclose(s, wf.abs().amax(1) / 127, rtol=1e-6, atol=0)
    assert (q.abs().amax(1) == 127).all()
    # dequantization error at most half a step (plus fp32 slack)
    err = (q.float() * s[:, None] - wf).abs()
    assert (err <= s[:, None] * (0.5 + 1e-5)).all()


def test_per_channel_all_zero_weight():
    q, s = ref.quantize_weight_per_channel(torch.zeros(3, 5, dtype=torch.bfloat16))
    assert s.tolist() == [1.0, 1.0, 1.0]
    assert (q == 0).all()
    assert not torch.isnan(ref.dequantize_weight(q, s)).any()


def test_per_channel_fp32_with_bf16_compute_dtype_equals_bf16_cast():
    g = torch.Generator().manual_seed(1)
    w32 = torch.randn(128, 256, generator=g) * 0.05
    q_c, s_c = ref.quantize_weight_per_channel(w32, compute_dtype=torch.bfloat16)
    q_b, s_b = ref.quantize_weight_per_channel(w32.to(torch.bfloat16))
    assert torch.equal(q_c, q_b) and torch.equal(s_c, s_b)
    # ...and the compute dtype does matter for these weights (so the equality above has teeth):
    q_f, s_f = ref.quantize_weight_per_channel(w32)
    assert not (torch.equal(q_f, q_b) and torch.equal(s_f, s_b))


def test_per_channel_rejects_bad_input():
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ref.quantize_weight_per_channel(torch.zeros(4))
    with pytest.raises(ValueError, match="weight dtype"):
        ref.quantize_weight_per_channel(torch.zeros(2, 2, dtype=torch.int8))


def _per_channel_definition(w, compute_dtype=None):
    """The per-channel semantics as one whole-tensor torch chain (what the strip-wise kernel
    must reproduce bit for bit): absmax = max(amax, -amin) in the weight's dtype, scale =
    absmax / 127 in fp32 (1.0 for an all-zero row), q = round_half_even(w / scale) in fp32."""
    if compute_dtype is not None:
        w = w.to(compute_dtype)
    absmax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg()).float()
    scale = torch.where(absmax > 1e-30, absmax / 127, torch.ones_like(absmax))
    return torch.round(w.float() / scale[:, None]).to(torch.int8), scale


def _tie_heavy_weight(rows, cols, dtype, seed):
    """Random rows mixed with rows whose values sit exactly on half steps of their scale (ties
    that round half to even), rows led by their negative extreme, all-zero and tiny rows: where
    a reordered or reciprocal-multiplied division would give a different int8."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.1
    k = torch.randint(-127, 127, (rows, cols), generator=g).float() + 0.5
    ties = k * 2.0 ** torch.randint(-12, 3, (rows, 1), generator=g).float()
    ties[:, 0] = 127 * ties[:, 1:].abs().amax(1) / 126.5  # a row max that makes scale a power-of-2 ratio
    pick = torch.arange(rows) % 3 == 1
    w[pick] = ties[pick]
    w[torch.arange(rows) % 7 == 3] *= -1
    w[5] = 0.0
    w[6] = 1e-35
    w[7, 3] = -w[7].abs().amax() * 2  # negative absmax
    return w.to(dtype)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype,compute", [(torch.bfloat16, None), (torch.float16, None),
                                           (torch.float32, None), (torch.float32, torch.bfloat16)],
                         ids=["bf16", "fp16", "fp32", "fp32-as-bf16"])
def test_per_channel_strips_bit_identical_to_definition(monkeypatch, dtype, compute, transposed):
    """The strip-wise reference kernel equals the whole-tensor definition bit for bit (int8 and
    scales), with several strips and a ragged last one (small strips forced)."""
    monkeypatch.setattr(ref, "_BLOCK_ELEMS", 256)
    w = _tie_heavy_weight(150, 96, dtype, seed=3)
    q, s = ref.quantize_weight_per_channel(w, compute, transposed=transposed)
    q_def, s_def = _per_channel_definition(w, compute)
    assert torch.equal(s, s_def)
    assert torch.equal(q, q_def)
    assert (q.t().is_contiguous() if transposed else q.is_contiguous())
    assert (q.abs() == 127).any(1)[s_def != 1.0].all()  # the data did reach the int8 extremes
    assert ((w.float()[1::3] / s_def[1::3, None]).frac().abs() == 0.5).any()  # and exact ties


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("transposed", [False, True])
def test_per_channel_refuses_nan_inf_in_any_strip(monkeypatch, bad, transposed):
    monkeypatch.setattr(ref, "_BLOCK_ELEMS", 256)
    w = torch.ones(150, 96, dtype=torch.bfloat16)
    w[149, 95] = bad  # in the last (ragged) strip
    with pytest.raises(ValueError, match="quantize_weight_per_channel: weight contains NaN or Inf"):
        ref.quantize_weight_per_channel(w, transposed=transposed)


# --------------------------------------------------------------------------- fixed scales (FlashRL)

def test_with_scales_hand_computed():
    w = _t([[1.0, -2.0, 100.0], [0.25, 3.0, -0.5]], torch.bfloat16)
    out_s = _t([[3.0], [2.0]], torch.float32)
    in_s = _t([[0.5, 1.0, 2.0]], torch.float32)
    # row 0: [1*3*.5, -2*3*1, 100*3*2] = [1.5, -6, 600] -> [2, -6, 127]
    # row 1: [.25*2*.5, 3*2*1, -.5*2*2] = [0.25, 6, -2] -> [0, 6, -2]
    q = ref.quantize_weight_with_scales(w, out_s, in_s)
    assert q.dtype == torch.int8
    assert q.tolist() == [[2, -6, 127], [0, 6, -2]]
    # scalar scales: [[2.5, -5, 250], [.625, 7.5, -1.25]] -> [[2, -5, 127], [1, 8, -1]]
    assert ref.quantize_weight_with_scales(w, 2.5).tolist() == [[2, -5, 127], [1, 8, -1]]
    with pytest.raises(ValueError, match="output_scale"):
        ref.quantize_weight_with_scales(w, torch.ones(3, 1))
    with pytest.raises(ValueError, match="input_scale"):
        ref.quantize_weight_with_scales(w, out_s, torch.ones(1, 2))


@pytest.fixture
def flashrl_linear_quantize(monkeypatch):
    """flash_rl 1.0.3's `linear_quantize`, runnable on CPU.

    It calls `torch.cuda.current_device()` only to pick the device its scales are moved to
    (`move_to_device(..., device)`); on a CPU-only torch that call raises. Returning "cpu" keeps
    every arithmetic step of the function unchanged and makes it move the scales to the CPU.
    Importing flash_rl also attaches a handler to the root logger; undo that so other tests'
    logging is unaffected.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from flash_rl.flash_quantization import linear_quantize
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return linear_quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_with_scales_matches_flashrl_linear_quantize(flashrl_linear_quantize, dtype):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(48, 80, generator=g) * 0.05).to(dtype)
    out_s = (127.0 / (torch.rand(48, 1, generator=g) * 0.2 + 0.05)).float()
    in_s = (torch.rand(1, 80, generator=g) * 1.5 + 0.25).float()
    profile = {"layer.weight": {"output_scale": out_s, "input_scale": in_s, "type": torch.int8}}
    expected = flashrl_linear_quantize("layer.weight", w, profile)
    assert expected.dtype == torch.int8
    got = ref.quantize_weight_with_scales(w, out_s, in_s)
    assert torch.equal(got, expected)
    # some values saturate and some do not, so both branches of the clamp are compared
    assert (expected.abs() == 127).any() and (expected.abs() < 127).any()


# --------------------------------------------------------------------------- npu_quant_matmul

@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_quant_matmul_int32_accumulation_is_exact(out_dtype):
    # K = 4096; all 127s except one product of 127*1:
    # acc = 127*127*4095 + 127 = 66_048_255 + 127 = 66_048_382.
    # That lies in [2^25, 2^26) where fp32 steps are 4, and 66_048_382 % 4 == 2: an fp32
    # accumulator cannot hold it. Cancel it with an int32 bias of -(66_048_382 - 5), so an exact
    # int32 accumulator gives 5 (exact in every output dtype) and an fp32 one 3 or 7.
    k = 4096
    x1 = torch.full((1, k), 127, dtype=torch.int8)
    x2 = torch.full((k, 1), 127, dtype=torch.int8)
    x2[7, 0] = 1
    exact = 127 * 127 * 4095 + 127
    assert exact == 66_048_382 and exact % 4 == 2
    bias = torch.tensor([-(exact - 5)], dtype=torch.int32)
    out = ref.npu_quant_matmul(x1, x2, torch.tensor([1.0]), bias=bias, output_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert out.item() == 5.0


def test_quant_matmul_large_k_all_127():
    # 127*127*4096 = 66_064_384 (> 2^24, fp32's exact-integer range); with scale 2^-12 the
    # result is 16129 exactly.
    x1 = torch.full((2, 4096), 127, dtype=torch.int8)
    x2 = torch.full((4096, 3), 127, dtype=torch.int8)
    out = ref.npu_quant_matmul(x1, x2, torch.tensor([2.0 ** -12]), output_dtype=torch.bfloat16)
    assert out.float().tolist() == [[16128.0] * 3] * 2  # 16129 in bf16 (8 significant bits): 16128


def test_quant_matmul_per_channel_and_pertoken_scale():
    x1 = _t([[1, 2], [3, -1]], torch.int8)
    x2 = _t([[1, 0, 2], [0, 1, -1]], torch.int8)
    # acc = [[1, 2, 0], [3, -1, 7]]
    scale = _t([1.0, 0.5, 0.25], torch.float32)
    out = ref.npu_quant_matmul(x1, x2, scale, output_dtype=torch.bfloat16)
    assert out.float().tolist() == [[1.0, 1.0, 0.0], [3.0, -0.5, 1.75]]
    pt = _t([2.0, 4.0], torch.float32)
    out = ref.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt, output_dtype=torch.float16)
    assert out.float().tolist() == [[2.0, 2.0, 0.0], [12.0, -2.0, 7.0]]
    # per-tensor scale (1 element)
    out = ref.npu_quant_matmul(x1, x2, _t([0.5], torch.float32), output_dtype=torch.bfloat16)
    assert out.float().tolist() == [[0.5, 1.0, 0.0], [1.5, -0.5, 3.5]]


def test_quant_matmul_int32_bias_before_scale_float_bias_after():
    x1 = _t([[1, 2]], torch.int8)
    x2 = _t([[3], [4]], torch.int8)  # acc = 11
    scale = _t([0.5], torch.float32)
    pt = _t([3.0], torch.float32)
    # int32 bias 4 joins the accumulator: (11 + 4) * 0.5 * 3 = 22.5
    out_i = ref.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt,
                                 bias=_t([4], torch.int32), output_dtype=torch.bfloat16)
    assert out_i.item() == 22.5
    # float bias 4.0 is added after both scales: 11 * 0.5 * 3 + 4 = 20.5 (the documented float
    # biases: bfloat16 / float32)
    for bdt, out_dt in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                        (torch.float32, torch.float16)):
        out_f = ref.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt,
                                     bias=_t([4.0], bdt), output_dtype=out_dt)
        assert out_f.item() == 20.5


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_quant_matmul_output_dtype(out_dtype):
    x1 = _t([[1, 0], [0, 1]], torch.int8)
    x2 = _t([[1], [3]], torch.int8)  # acc = [[1], [3]]
    out = ref.npu_quant_matmul(x1, x2, _t([1.0 / 3.0], torch.float32), output_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (2, 1)
    # 1 * (1/3) rounds once, into the output dtype; 3 * fl32(1/3) = 1.0000000298 -> 1.0
    assert out[0, 0].item() == torch.tensor(1.0 / 3.0, dtype=torch.float64).to(out_dtype).item()
    assert out[1, 0].item() == 1.0


def test_quant_matmul_batched_x1():
    x1 = _t([[[1, 2]], [[-1, 1]]], torch.int8)  # [2, 1, 2]
    x2 = _t([[2], [1]], torch.int8)
    out = ref.npu_quant_matmul(x1, x2, _t([2.0], torch.float32), output_dtype=torch.bfloat16)
    assert out.shape == (2, 1, 1)
    assert out.flatten().tolist() == [8.0, -2.0]  # [(1*2+2*1)*2, (-2+1)*2]


def _fp32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def test_int64_deq_scale_decoding():
    # fp32 0.25: sign 0, exponent 125 (0x7D), mantissa 0 -> 0x7D << 23 = 0x3E800000
    # fp32 1.5:  exponent 127, mantissa .5 -> 0x3F800000 | 0x400000 = 0x3FC00000
    assert _fp32_bits(0.25) == 0x3E800000 and _fp32_bits(1.5) == 0x3FC00000
    # npu_trans_quant_param puts the fp32 bits in the low 32 bits; set a high bit too, which
    # decoding must ignore.
    enc = torch.tensor([0x3E800000, 0x3FC00000 | (1 << 46)], dtype=torch.int64)
    assert ref.decode_deq_scale(enc).tolist() == [0.25, 1.5]
    x1 = _t([[4, 2]], torch.int8)
    x2 = _t([[1, 1], [0, 3]], torch.int8)  # acc = [4, 10]
    out = ref.npu_quant_matmul(x1, x2, enc, output_dtype=torch.float16)
    assert out.dtype == torch.float16
    assert out.tolist() == [[1.0, 15.0]]


def test_quant_matmul_rejects_bad_inputs():
    x2 = torch.zeros(4, 3, dtype=torch.int8)
    s = torch.ones(1)
    with pytest.raises(ValueError, match="x1: dtype must be one of int8"):
        ref.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.float16), x2, s, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x1: dtype must be one of int8"):
        ref.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.int32), x2, s, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x2: dtype must equal x1's"):
        ref.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.int8), x2.float(), s, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x1: must have 2-6 dims"):
        ref.npu_quant_matmul(torch.zeros(4, dtype=torch.int8), x2, s, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x1: last dim"):
        ref.npu_quant_matmul(torch.zeros(2, 5, dtype=torch.int8), x2, s, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        ref.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.int8), x2, torch.ones(2),
                             output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pertoken_scale"):
        ref.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.int8), x2, s,
                             pertoken_scale=torch.ones(3), output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        ref.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.int8), x2, s,
                             bias=torch.ones(2), output_dtype=torch.bfloat16)


def test_quant_matmul_dim_limit():
    # K = 65536 (x1 [1, 65536], x2 [65536, 1]: 128 KiB of int8) is rejected; K = 65535 is not.
    with pytest.raises(ValueError, match=r"k=65536"):
        ref.npu_quant_matmul(torch.ones(1, 65536, dtype=torch.int8),
                             torch.ones(65536, 1, dtype=torch.int8), torch.ones(1),
                             output_dtype=torch.bfloat16)
    # N = 65536 (a vocab-sized lm_head) is rejected too.
    with pytest.raises(ValueError, match=r"n=65536"):
        ref.npu_quant_matmul(torch.ones(1, 1, dtype=torch.int8),
                             torch.ones(1, 65536, dtype=torch.int8), torch.ones(1),
                             output_dtype=torch.bfloat16)
    out = ref.npu_quant_matmul(torch.ones(1, 65535, dtype=torch.int8),
                               torch.ones(65535, 1, dtype=torch.int8), torch.ones(1) / 4096,
                               output_dtype=torch.float16)
    assert out.item() == torch.tensor(65535.0 / 4096, dtype=torch.float16).item()  # exact acc, one rounding


def test_dynamic_quant_rejects_bad_inputs():
    with pytest.raises(ValueError, match="x: dtype must be one of float16, bfloat16"):
        ref.npu_dynamic_quant(torch.zeros(2, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match="more than 1 dim"):
        ref.npu_dynamic_quant(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="smooth_scales"):
        ref.npu_dynamic_quant(torch.zeros(2, 3, dtype=torch.bfloat16),
                              smooth_scales=torch.ones(2, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- format casts

def test_format_cast_roundtrip_keeps_values():
    w = torch.arange(-64, 64, dtype=torch.int8).reshape(8, 16)
    before = w.clone()
    assert ref.get_npu_format(w) == ref.ACL_FORMAT_ND == 2
    nz = ref.npu_format_cast(w, 29)
    assert ref.get_npu_format(nz) == ref.ACL_FORMAT_FRACTAL_NZ == 29
    assert torch.equal(nz, before) and nz.shape == (8, 16)
    # The format belongs to the storage: a Parameter / .data alias of it reports NZ as well.
    p = torch.nn.Parameter(nz, requires_grad=False)
    assert ref.get_npu_format(p.data) == 29
    back = ref.npu_format_cast(nz, 2)
    assert ref.get_npu_format(back) == 2
    assert torch.equal(back, before)
    # in-place variant
    ref.npu_format_cast_(w, 29)
    assert ref.get_npu_format(w) == 29
    ref.npu_format_cast_(w, 2)
    assert ref.get_npu_format(w) == 2
    # an unrelated tensor is ND
    assert ref.get_npu_format(w.clone()) == 2


def test_format_not_inherited_by_reused_memory():
    # A freed NZ tensor's memory is commonly reused by the next allocation of the same size; a
    # brand-new tensor must still report ND (2).
    for n in (4096, 1 << 16):
        for _ in range(3):
            t = ref.npu_format_cast(torch.zeros(n, dtype=torch.int8), 29)
            assert ref.get_npu_format(t) == 29
            del t
            fresh = torch.ones(n, dtype=torch.int8)
            assert ref.get_npu_format(fresh) == 2
            del fresh


# --------------------------------------------------------------------------- devices, NaN/Inf on the NPU path

@pytest.mark.parametrize("impl", [ref.quantize_weight_with_scales, kernels.quantize_weight_with_scales],
                         ids=["reference", "dispatch"])
@pytest.mark.parametrize("odd", ["output_scale", "input_scale", "weight"])
def test_with_scales_refuses_operands_on_different_devices(impl, odd):
    """A CPU profile scale times a device weight must be refused by name, not fail inside torch
    (CPU profile scales met device weights at the first sync). Stand-in for the second device: `meta` (no NPU on CPU CI); the kernel
    must refuse the cpu+meta mix exactly as it would refuse cpu+npu."""
    ops = {"weight": torch.ones(2, 3, dtype=torch.bfloat16), "output_scale": torch.ones(2, 1),
           "input_scale": torch.ones(1, 3)}
    ops[odd] = ops[odd].to("meta")
    with pytest.raises(ValueError, match=rf"quantize_weight_with_scales: operands are on different "
                                         rf"devices .*{odd} on meta"):
        impl(ops["weight"], ops["output_scale"], ops["input_scale"])
    # python-float scales have no device: nothing to refuse
    impl(torch.ones(2, 3, dtype=torch.bfloat16), 1.0, 1.0)


@pytest.fixture
def emulated_torch_npu():
    from npu_flashrl.kernels import emulation

    was = emulation.is_installed()
    emulation.install()
    yield
    if not was:
        emulation.uninstall()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_npu_per_channel_refuses_nan_inf_like_the_reference(emulated_torch_npu, bad, dtype):
    """kernels/npu.py refuses NaN/Inf as the reference does (a NaN weight must never become a finite int8). Stand-in: the
    emulated torch_npu (`npu_dynamic_quant` backed by the reference op), since CI has no NPU; the
    refusal itself runs before any torch_npu op, in the NPU module's own code."""
    from npu_flashrl.kernels import npu

    w = _t(_W, dtype)
    w[1, 2] = bad
    with pytest.raises(ValueError, match="quantize_weight_per_channel: weight contains NaN or Inf"):
        ref.quantize_weight_per_channel(w)
    with pytest.raises(ValueError, match="quantize_weight_per_channel: weight contains NaN or Inf"):
        npu.quantize_weight_per_channel(w)
    # fp32 1e5 is finite, but Inf in an fp16 rollout model: refused in the compute dtype
    big = _t(_W, torch.float32)
    big[0, 0] = 1e5
    npu.quantize_weight_per_channel(big)
    with pytest.raises(ValueError, match="NaN or Inf"):
        npu.quantize_weight_per_channel(big, compute_dtype=torch.float16)


def test_npu_per_channel_matches_reference_on_finite_input(emulated_torch_npu):
    from npu_flashrl.kernels import npu

    q, s = npu.quantize_weight_per_channel(_t(_W, torch.bfloat16))
    assert q.tolist() == _Q and s.tolist() == _S
