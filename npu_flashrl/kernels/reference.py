"""Pure-torch reference INT8 kernels. These DEFINE the semantics npu_flashrl relies on.

The torch_npu ops emulated here follow the torch_npu API reference: computation in fp32, round
half to even (`torch.round`; each op's docstring says what its page says about rounding),
saturation to the int8 range. Inputs the NPU op's page rejects are rejected here too
(`op_rules.py`, the page cited beside each rule), with an error naming the op, the argument and
the rule, so CPU CI catches what would fail on hardware.
"""
from __future__ import annotations

import weakref
from typing import Optional, Tuple, Union

import torch

from npu_flashrl.kernels import op_rules

INT8_MIN, INT8_MAX = -128, 127
# torch_npu / CANN storage formats (acl format ids).
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
# npu_quant_matmul: the last dims of x1 and x2 must not exceed this (documented limit).
MAX_MATMUL_DIM = op_rules.QUANT_MATMUL_MAX_LAST_DIM
# A row whose absmax is below this gets scale 1.0: all its values quantize to 0 either way,
# and 1.0 keeps dequantization finite (no 0/0).
_ZERO_ROW_EPS = 1e-30

_FLOAT_IN = (torch.float16, torch.bfloat16)
_FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32)


def _require(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def require_same_device(op: str, **operands) -> None:
    """Refuse tensor operands on different devices, naming each operand and its device (a CPU
    scale times an NPU weight would otherwise fail deep inside torch, naming neither)."""
    devices = {n: t.device for n, t in operands.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: operands are on different devices ({listing}); move them to "
                         "one device first")


def all_finite(t: torch.Tensor) -> bool:
    """One reduction pass over `t`, no temporary of its size (NaN propagates through min/max).
    A `meta` tensor has no values: nothing to refuse."""
    if t.device.type == "meta" or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _saturate_int8(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


# --------------------------------------------------------------------------- weights

# Weights are quantized in row blocks of about this many elements: the fp32 work buffer stays in
# cache and the extra memory is a few MB instead of several fp32 copies of the whole tensor.
_BLOCK_ELEMS = 1 << 18


def _row_blocks(rows: int, cols: int):
    step = max(1, _BLOCK_ELEMS // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


_TILE = 512  # a 512x512 tile of source and destination stays in cache while it is transposed


def _quantize_blocks(weight: torch.Tensor, block_fn, transposed: bool) -> torch.Tensor:
    """Apply `block_fn(r0, r1, c0, c1, out_fp32) -> fp32 block` over the weight and store it as
    int8, in row blocks, or for `transposed` as an [out, in] view of [in, out]-contiguous memory
    (vllm-ascend's processed layout) written tile by tile: no full-size temporary, and on CPU
    ~2.5x faster than quantizing first and transposing the int8 matrix afterwards."""
    rows, cols = weight.shape
    if not transposed:
        q = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
        buf = torch.empty((min(rows, max(1, _BLOCK_ELEMS // max(cols, 1))), cols),
                          dtype=torch.float32, device=weight.device)
        for r0, r1 in _row_blocks(rows, cols):
            q[r0:r1].copy_(block_fn(r0, r1, 0, cols, buf[: r1 - r0]))
        return q
    out = torch.empty((cols, rows), dtype=torch.int8, device=weight.device)
    buf = torch.empty((_TILE, _TILE), dtype=torch.float32, device=weight.device)
    tile = torch.empty((_TILE, _TILE), dtype=torch.int8, device=weight.device)
    for r0 in range(0, rows, _TILE):
        r1 = min(rows, r0 + _TILE)
        for c0 in range(0, cols, _TILE):
            c1 = min(cols, c0 + _TILE)
            t = tile[: r1 - r0, : c1 - c0]
            t.copy_(block_fn(r0, r1, c0, c1, buf[: r1 - r0, : c1 - c0]))  # fp32 -> int8 first:
            out[c0:c1, r0:r1].copy_(t.t())                              # a 4x smaller transpose
    return out.t()


def quantize_weight_per_channel(weight: torch.Tensor,
                                compute_dtype: Optional[torch.dtype] = None,
                                transposed: bool = False,
                                finite: Optional[list] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: weight [out, in] -> (int8 [out, in], fp32 scale [out]).

    scale = absmax(row) / 127 and q = round_half_even(w / scale), both in fp32 (|w / scale| <= 127
    by construction, so no saturation is needed). This is `npu_dynamic_quant` applied to the
    weight rows, so the NPU path can use that op. `compute_dtype` (the rollout model's dtype,
    e.g. bf16) is applied first: fp32 FSDP masters then quantize exactly like their bf16 cast.
    An all-zero row gets scale 1.0 (q = 0). NaN or Inf raise ValueError.
    `transposed=True` returns the same values as an [out, in] view of [in, out]-contiguous memory
    (the layout vllm-ascend's processed W8A8 weights use). `finite` (a list): the NaN / Inf
    refusal is appended to it as a device-side bool instead of raised (see `kernels`).
    """
    op = "quantize_weight_per_channel"
    _require(weight.dim() == 2, op, f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    _require(weight.dtype in _FLOAT_WEIGHTS, op,
             f"weight dtype must be one of {_FLOAT_WEIGHTS}, got {weight.dtype}")
    if compute_dtype is not None and weight.dtype != compute_dtype:
        weight = weight.to(compute_dtype)
    q, absmax, scale = _per_channel_strips(weight, transposed)
    # NaN propagates through amax/amin, -Inf shows as +Inf after the negation
    if finite is not None:  # the caller reads it back (with others) before using the result
        finite.append(torch.isfinite(absmax).all())
    else:
        _require(all_finite(absmax), op, "weight contains NaN or Inf")
    return q, scale


# The per-channel quantizer's fp32 work buffer: 4 blocks (1 M elements, 4 MB), so a 7B gate_up
# projection takes 130 chunks of three operations, not 520 strips of twelve; larger chunks cut
# the count further but leave the CPU's cache between the division and the int8 write (~2x
# slower on CPU, measured).
_CHUNK_BLOCKS = 4


def _strip_rows(cols: int) -> int:
    return max(1, (_BLOCK_ELEMS * _CHUNK_BLOCKS) // max(cols, 1))


def _per_channel_strips(weight: torch.Tensor, transposed: bool):
    """(q, absmax, scale) of `quantize_weight_per_channel` in a few whole-tensor operations:
    the row extremes over the whole weight in its own dtype (exact: min, max and negation
    never round), the scales of all rows at once, then q = round(w / scale) in fp32 over chunks
    of at most `_CHUNK_BLOCKS` row blocks, each written straight into the int8 result (for
    `transposed`, into the [in, out] memory through a transposed view). The chunks bound the fp32
    temporary; their count, not the row count, sets the number of operations (a device runs each
    as one kernel launch). Elementwise the same operations as the definition (absmax =
    max(amax, -amin); scale = absmax / 127 or 1.0; q = round_half_even(w / scale) in fp32), so
    the result is bit-identical to it (tests/kernels/test_kernels.py compares the two)."""
    rows, cols = weight.shape
    dev = weight.device
    # two reductions: torch's CPU aminmax is ~10x slower than amax and amin on 16-bit floats
    absmax = torch.maximum(torch.amax(weight, dim=1), torch.amin(weight, dim=1).neg_()).float()
    scale = torch.where(absmax > _ZERO_ROW_EPS, absmax / INT8_MAX, 1.0)
    out = torch.empty((cols, rows) if transposed else (rows, cols), dtype=torch.int8, device=dev)
    step = min(max(rows, 1), _strip_rows(cols))
    buf = torch.empty((step, cols), dtype=torch.float32, device=dev)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        # fp32 division (a 16-bit weight is widened exactly), then round half to even in place:
        # |b| <= 127, so the int8 cast in the copy is exact
        b = torch.div(weight[r0:r1], scale[r0:r1, None], out=buf[: r1 - r0]).round_()
        if transposed:
            out[:, r0:r1].copy_(b.t())
        else:
            out[r0:r1].copy_(b)
    return (out.t() if transposed else out), absmax, scale


def quantize_weight_with_scales(weight: torch.Tensor,
                                output_scale: Union[torch.Tensor, float],
                                input_scale: Union[torch.Tensor, float] = 1.0,
                                transposed: bool = False) -> torch.Tensor:
    """FlashRL's fixed-scale INT8: round(W * output_scale * input_scale).clamp(-128, 127).

    Same operation order and type promotion as flash_rl 1.0.3 `linear_quantize` (a bf16 weight
    times fp32 scales computes in fp32), so results match FlashRL bit for bit; computed in
    blocks (`transposed` as for `quantize_weight_per_channel`). output_scale is [out, 1] (or scalar), input_scale [1, in] (or scalar).
    NaN or Inf in the weight raise ValueError.
    """
    op = "quantize_weight_with_scales"
    _require(weight.dim() == 2, op, f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    for name, s, ok_shapes in (("output_scale", output_scale, ((weight.shape[0], 1), (1,), ())),
                               ("input_scale", input_scale, ((1, weight.shape[1]), (1,), ()))):
        if isinstance(s, torch.Tensor):
            _require(tuple(s.shape) in ok_shapes, op,
                     f"{name} shape {tuple(s.shape)} does not fit weight {tuple(weight.shape)}; "
                     f"expected one of {ok_shapes}")
    require_same_device(op, weight=weight, output_scale=output_scale, input_scale=input_scale)
    _require(all_finite(weight), op, "weight contains NaN or Inf")
    os_rows = isinstance(output_scale, torch.Tensor) and output_scale.dim() == 2
    is_cols = isinstance(input_scale, torch.Tensor) and input_scale.dim() == 2

    def block(r0, r1, c0, c1, buf):
        os_blk = output_scale[r0:r1] if os_rows else output_scale
        is_blk = input_scale[:, c0:c1] if is_cols else input_scale
        # per element (w * os) * is: FlashRL's order and fp32 promotion
        vals = torch.mul(weight[r0:r1, c0:c1], os_blk, out=buf).mul_(is_blk)
        return vals.round_().clamp_(INT8_MIN, INT8_MAX)

    return _quantize_blocks(weight, block, transposed)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] * scale [out] (or [out, 1]) -> fp32."""
    return q.float() * scale.reshape(-1, 1).float()


# --------------------------------------------------------------------------- torch_npu ops

# npu_quantize's documented output types (div_mode True: qint8 / quint8 / int32; False: qint8)
_QDTYPES = {torch.qint8: (torch.int8, -128, 127), torch.quint8: (torch.uint8, 0, 255),
            torch.int32: (torch.int32, -2**31, 2**31 - 1)}


def _broadcast_along(t: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """`t` (1 or x.shape[axis] values, 1-D or of x's rank; shapes checked by op_rules) shaped
    to broadcast against x along `axis`."""
    if t.numel() == 1:
        return t.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.reshape(shape)


def npu_quantize(x: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor],
                 dtype: torch.dtype, axis: int = 1, div_mode: bool = True) -> torch.Tensor:
    """torch_npu.npu_quantize: x / scales + zero_points (div_mode) or x * scales + zero_points,
    in fp32, then the output type with saturation to its range. Output has the shape of x.
    Rounding: the page's formula does not name a rounding mode; the emulation rounds half to
    even (`torch.round`). Documented constraints: `op_rules.check_quantize`."""
    require_same_device("npu_quantize", x=x, scales=scales, zero_points=zero_points)
    op_rules.check_quantize(x, scales, zero_points, dtype, axis, div_mode)
    out_dtype, lo, hi = _QDTYPES[dtype]
    ax = axis % x.dim()
    s = _broadcast_along(scales.float(), x, ax)
    y = x.float() / s if div_mode else x.float() * s
    if zero_points is not None:
        y = y + _broadcast_along(zero_points.float(), x, ax)
    return torch.round(y).clamp_(lo, hi).to(out_dtype)


def npu_dynamic_quant(x: torch.Tensor, smooth_scales: Optional[torch.Tensor] = None, *,
                      group_index: Optional[torch.Tensor] = None,
                      dst_type: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_dynamic_quant: per-token symmetric int8.

    x (fp16/bf16, ndim >= 2) is optionally multiplied by smooth_scales [x.shape[-1]] (x's dtype);
    then scale = rowmax|x| / 127 (fp32, shape x.shape[:-1]) and y = round(x / scale) as int8.
    Rounding: the page's formula says round(); Huawei's own op test
    (op-plugin test/test_custom_ops/test_npu_dynamic_quant.py) builds its golden with
    `torch.round` (half to even) and accepts a difference of 1, which the emulation's half-even
    rounding is within. Documented example: [0.7261, 0.3726, 0.9126] -> [101, 52, 127].
    Not emulated: the int4 output (dst_type quint4x2) and MoE `group_index`.
    Documented constraints: `op_rules.check_dynamic_quant`."""
    op = "npu_dynamic_quant"
    require_same_device(op, x=x, smooth_scales=smooth_scales, group_index=group_index)
    op_rules.check_dynamic_quant(x, smooth_scales, group_index, dst_type)
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"{op}: dst_type={dst_type} is not emulated (only torch.int8)")
    if group_index is not None:
        raise NotImplementedError(f"{op}: group_index (MoE groups) is not emulated")
    xf = x.float()
    if smooth_scales is not None:
        xf = xf * smooth_scales.float()
    absmax = xf.abs().amax(dim=-1)
    scale = absmax / INT8_MAX
    safe = torch.where(absmax > _ZERO_ROW_EPS, scale, torch.ones_like(scale))
    y = _saturate_int8(xf / safe.unsqueeze(-1))
    return y, scale


def decode_deq_scale(scale: torch.Tensor) -> torch.Tensor:
    """Dequant scales that vllm-ascend stores int64-encoded (fp16 models: npu_trans_quant_param):
    the low 32 bits hold the fp32 bit pattern."""
    if scale.dtype == torch.int64:
        return (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return scale.float()


def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *,
                     offset: Optional[torch.Tensor] = None,
                     pertoken_scale: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None,
                     output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch_npu.npu_quant_matmul: int8 x1 [..., M, K] @ int8 x2 [K, N] with int32 accumulation.

    The page's formulas: an int32 bias is added to the accumulator before scaling; then
    out = acc * scale[N] (* pertoken_scale[M] per row); a bfloat16 / float32 bias is added after
    scaling; cast to output_dtype (the float cast rounds to nearest even, as torch's). The
    accumulation is exact (float64 holds every int32 sum of K <= 65535 int8 products).
    Documented constraints (the dtype combination table included): `op_rules.check_quant_matmul`.
    The int32 output (a row of the page's table 2: scale float32 / bfloat16, no offset, bias
    int32 / None, no pertoken_scale) is the accumulator x1 @ x2 (+ an int32 bias), unscaled: the page
    gives no dequantization for it, and the current line's vllm-ascend (its shared experts, `fused_moe_0_23_0.py`)
    dequantizes that output afterwards with the same weight scale in npu_dequant_swiglu_quant.
    NOT VERIFIED ON HARDWARE (`npu-flashrl verify --kernels` compares it on an NPU host); a sum
    outside int32 is not emulated (the page does not say whether it wraps or saturates).
    Not emulated: the int8 output (the page does not say how it rounds) and batched x2;
    vllm-ascend passes a float or int32 output_dtype and a 2-D weight."""
    op = "npu_quant_matmul"
    require_same_device(op, x1=x1, x2=x2, scale=scale, offset=offset, pertoken_scale=pertoken_scale,
                        bias=bias)
    op_rules.check_quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype)
    if output_dtype in (None, torch.int8):
        raise NotImplementedError(f"{op}: the int8 output is not emulated; vllm-ascend passes a "
                                  "float or int32 output_dtype")
    if x2.dim() != 2 or (bias is not None and bias.dim() != 1):
        raise NotImplementedError(f"{op}: a batched x2 / 3-D bias is not emulated")
    acc = torch.matmul(x1.double(), x2.double())
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    if output_dtype == torch.int32:
        if acc.numel() and (acc.max() > 2**31 - 1 or acc.min() < -2**31):
            raise NotImplementedError(f"{op}: an int32 output outside the int32 range is not emulated")
        return acc.to(torch.int32)
    out = acc * decode_deq_scale(scale).double()
    if pertoken_scale is not None:
        out = out * pertoken_scale.double().reshape(pertoken_scale.shape[0], 1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.double()
    return out.to(output_dtype)


# Format casts change the storage layout only: on CPU they are the identity on values. The
# format is remembered per storage so get_npu_format answers like the NPU would. Keyed weakly by
# the storage object (torch keeps one Python object per live storage), not by its address: a
# freed NZ tensor's memory is reused by the allocator, and a new ND tensor there must not
# inherit format 29.
_formats: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _key(t: torch.Tensor):
    return t.untyped_storage()


def npu_format_cast(t: torch.Tensor, acl_format: int) -> torch.Tensor:
    """torch_npu.npu_format_cast: returns the tensor converted to `acl_format`; the input is left
    as it was (the page's example: x keeps its format, x1 = npu_format_cast(x, 29) has 29). A
    conversion gives a new tensor (same values here: the emulated layouts do not change
    bytes); a cast to the format the tensor already has returns it unchanged (the page is silent
    on that case: there is nothing to convert)."""
    op_rules.check_format_cast(acl_format)
    if get_npu_format(t) == acl_format:
        return t
    out = t.detach().clone() if not t.requires_grad else t.clone()
    _set_format(out, acl_format)
    return out


def npu_format_cast_(t: torch.Tensor, acl_format: int) -> torch.Tensor:
    """The in-place form (Tensor.npu_format_cast_): `t` itself changes format."""
    op_rules.check_format_cast(acl_format)
    _set_format(t, acl_format)
    return t


def _base_format(t: torch.Tensor) -> int:
    # get_npu_format of a fresh tensor: 0 (NCHW) for the 4-D tensor of the page's example, ND
    # otherwise
    return op_rules.ACL_FORMAT_NCHW if t.dim() == 4 else ACL_FORMAT_ND


def _set_format(t: torch.Tensor, acl_format: int) -> None:
    if acl_format == _base_format(t):
        _formats.pop(_key(t), None)
    else:
        _formats[_key(t)] = acl_format


def get_npu_format(t: torch.Tensor) -> int:
    """torch_npu.get_npu_format: the acl format id of `t`'s storage."""
    return _formats.get(_key(t), _base_format(t))
