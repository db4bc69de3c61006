"""W4A8_DYNAMIC's int4 math: the pure-torch reference that DEFINES the semantics, and the two
torch_npu ops vllm-ascend's W4A8_DYNAMIC linear layers call, emulated for NPU-free runs.

The weight format (what vllm-ascend's `AscendW4A8DynamicLinearMethod` loads, ModelSlim's
original layout; ModelSlim's `llm_ptq` writer, `save/complex_quantifier.py`, calls it staged
quantization, "分阶段量化": float -> int8 first, then int8 -> int4):

- stage 1, per output channel: `weight_scale[n] = absmax(w[n, :]) / 127` (1.0 for an all-zero
  row), `w8 = round_half_even(w / weight_scale)` (within [-127, 127] by construction);
  `weight_offset = 0` (symmetric: ModelSlim refuses W4A8_DYNAMIC without `w_sym`);
- stage 2, per group of `group_size` consecutive INPUT channels of one output channel (group
  `g` holds columns `g*group_size .. (g+1)*group_size-1`; vllm-ascend's default 256):
  `weight_scale_second[n, g] = absmax(w8[n, group]) / 7` (1.0 for an all-zero group),
  `q4 = clamp(round_half_even(w8 / weight_scale_second), -8, 7)`; `weight_offset_second = 0`;
- the checkpoint holds `q4` as int8 [out, in], `weight_scale` / `weight_offset` [out, 1] and
  `weight_scale_second` / `weight_offset_second` [out, in // group_size]; the float weight is
  `w ~= weight_scale[n] * weight_scale_second[n, g] * q4[n, k]`.

Per-channel (`group_size` 0; vllm-ascend's W4A8_DYNAMIC fused-MoE method only, whose linear
method has no such mode): ONE stage, `weight_scale[n] = absmax(w[n, :]) / 7` (1.0 for an all-zero
row), `q4 = clamp(round_half_even(w / weight_scale), -8, 7)`, `weight_offset = 0`; the checkpoint
holds `q4` int8 [out, in] and `weight_scale` / `weight_offset` [out, 1], no second level (the
layout vllm-ascend's MoE method creates when `group_size == 0`); `w ~= weight_scale[n] * q4[n, k]`.
ModelSlim's per-channel W4A8 recipes (e.g. msmodelslim `lab_practice/deepseek_v3/
deepseek_w4a8_per_channel.yaml`: experts int4 per_channel symmetric, method "ssz") may search
their scales: a ModelSlim checkpoint's experts then differ from this min-max rule, and after the
first sync the rollout holds this rule's.

All arithmetic is fp32 (the model dtype, e.g. bf16, is applied to the weight first, as for INT8).
ModelSlim's own quantizer is compiled (`quant_funcs*.so`): its rounding cannot be read, so this
module names its own (half to even, `torch.round`) and the scheme quantizes every sync with it;
a checkpoint written by ModelSlim may differ from it by one int4 step where a value sits on a .5
tie. The layer only needs the format, which is ModelSlim's.

Packing (`npu_convert_weight_to_int4pack`): 8 int4 values in one int32 along the LAST dim. The
page says the values are "packed ... and interleaved" ("交叠排放") without giving the nibble
order; the emulation puts element `8*j + i` in bits `4*i .. 4*i+3` of int32 `j` (two's-complement
nibbles, the low nibble first, as ModelSlim / vllm-ascend pack two int4 into one int8). Not
verified on hardware: `npu-flashrl verify --kernels` on an Atlas A2 / A3 node compares the
device's packing with this one (the `npu_convert_weight_to_int4pack` row). Every consumer in
npu_flashrl packs with the op it runs against (the emulation here, the device op on an NPU), so
a sync equals a fresh load on both.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from npu_flashrl.kernels import op_rules_int4
from npu_flashrl.kernels.reference import all_finite, require_same_device

INT4_MIN, INT4_MAX = -8, 7
INT4_PER_INT32 = 8
STAGE1_MAX = 127  # the int8 stage
DEFAULT_GROUP_SIZE = 256  # vllm-ascend's default when the description has no group_size
_ZERO_EPS = 1e-30
_FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass
class W4A8Weight:
    """One projection in the ModelSlim W4A8_DYNAMIC checkpoint format (offsets are zero)."""

    q: torch.Tensor  # int8 [out, in], values in [-8, 7]
    scale: torch.Tensor  # fp32 [out]: stage 1 (weight_scale); per-channel: the only scale
    # fp32 [out, in // group_size]: stage 2 (weight_scale_second); None per-channel (group_size 0)
    scale_second: Optional[torch.Tensor]
    group_size: int  # 0: per-channel

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]: scale[n] * scale_second[n, g] * q[n, k] (per-channel: scale[n] * q[n, k])."""
        if self.scale_second is None:
            return self.q.float() * self.scale.unsqueeze(1)
        s2 = self.scale_second.repeat_interleave(self.group_size, dim=1)
        return self.q.float() * s2 * self.scale.unsqueeze(1)


def _require(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def check_group_size(group_size, in_features: int, where: str = "group_size") -> None:
    """A positive int that divides the input size (vllm-ascend sizes weight_scale_second as
    in // group_size: a remainder would leave columns without a scale)."""
    _require(isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0,
             "quantize_weight_w4a8", f"{where} must be a positive int, got {group_size!r}")
    _require(in_features % group_size == 0, "quantize_weight_w4a8",
             f"{where}={group_size} must divide the input size {in_features} (vllm-ascend's "
             f"weight_scale_second has in // group_size columns)")


def quantize_weight_w4a8(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                         compute_dtype: Optional[torch.dtype] = None) -> W4A8Weight:
    """float [out, in] -> the staged W4A8 format of the module docstring (`group_size` 0: the
    per-channel format, `quantize_weight_w4a8_per_channel`). NaN / Inf, a non-2-D weight, an
    integer dtype or a group size that does not divide `in` raise ValueError."""
    if group_size == 0 and not isinstance(group_size, bool):
        return quantize_weight_w4a8_per_channel(weight, compute_dtype)
    w = _checked_float(weight, compute_dtype, group_size)
    out, inp = w.shape
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > _ZERO_EPS, absmax / STAGE1_MAX, torch.ones_like(absmax))
    w8 = torch.round(w / scale.unsqueeze(1))  # |w8| <= 127 by construction
    groups = w8.reshape(out, inp // group_size, group_size)
    gmax = groups.abs().amax(dim=2)
    s2 = torch.where(gmax > 0, gmax / INT4_MAX, torch.ones_like(gmax))
    q = torch.round(groups / s2.unsqueeze(2)).clamp_(INT4_MIN, INT4_MAX)
    return W4A8Weight(q=q.reshape(out, inp).to(torch.int8), scale=scale, scale_second=s2,
                      group_size=group_size)


def _checked_float(weight: torch.Tensor, compute_dtype: Optional[torch.dtype],
                   group_size: Optional[int]) -> torch.Tensor:
    """`weight` as fp32 after its checks (`group_size` None: no group to check)."""
    op = "quantize_weight_w4a8"
    _require(weight.dim() == 2, op, f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    _require(weight.dtype in _FLOAT_WEIGHTS, op, f"weight dtype must be one of {_FLOAT_WEIGHTS}, got {weight.dtype}")
    if group_size is not None:
        check_group_size(group_size, weight.shape[1])
    _require(all_finite(weight), op, "weight contains NaN or Inf")
    if compute_dtype is not None and weight.dtype != compute_dtype:
        weight = weight.to(compute_dtype)
    return weight.float()


def quantize_weight_w4a8_per_channel(weight: torch.Tensor,
                                     compute_dtype: Optional[torch.dtype] = None) -> W4A8Weight:
    """float [out, in] -> the per-channel W4A8 format of the module docstring (one fp32 scale per
    output channel, absmax / 7, no second level). Bad input raises ValueError as
    `quantize_weight_w4a8`."""
    w = _checked_float(weight, compute_dtype, None)
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > _ZERO_EPS, absmax / INT4_MAX, torch.ones_like(absmax))
    q = torch.round(w / scale.unsqueeze(1)).clamp_(INT4_MIN, INT4_MAX)
    return W4A8Weight(q=q.to(torch.int8), scale=scale, scale_second=None, group_size=0)


# --------------------------------------------------------------------------- packing

_SHIFTS = torch.arange(INT4_PER_INT32, dtype=torch.int64) * 4


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int [..., c] in [-8, 7], c % 8 == 0 -> int32 [..., c // 8] (element 8j+i in bits 4i..4i+3)."""
    v = values.to(torch.int64) & 0xF
    v = v.reshape(*values.shape[:-1], values.shape[-1] // INT4_PER_INT32, INT4_PER_INT32)
    word = (v << _SHIFTS.to(v.device)).sum(dim=-1)  # disjoint bits: the sum is the bitwise or
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)  # the int32 two's-complement value
    return word.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., c // 8] -> int8 [..., c] in [-8, 7] (the inverse of `pack_int4`)."""
    w = packed.to(torch.int64) & 0xFFFFFFFF
    nib = (w.unsqueeze(-1) >> _SHIFTS.to(w.device)) & 0xF
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * INT4_PER_INT32).to(torch.int8)


# --------------------------------------------------------------------------- torch_npu ops

def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """torch_npu.npu_convert_weight_to_int4pack: int32 [d0, d1] with values in [-8, 7] -> int32
    [d0, d1 / 8], ND (nibble order: module docstring). Constraints:
    `op_rules_int4.check_convert_weight_to_int4pack`."""
    op_rules_int4.check_convert_weight_to_int4pack(weight, inner_k_tiles)
    return pack_int4(weight)


def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset: Optional[torch.Tensor] = None,
                                 quant_scale: Optional[torch.Tensor] = None,
                                 quant_offset: Optional[torch.Tensor] = None,
                                 bias: Optional[torch.Tensor] = None, antiquant_group_size: int = 0,
                                 inner_precise: int = 0) -> torch.Tensor:
    """torch_npu.npu_weight_quant_batchmatmul without output quantization:
    y = x @ ANTIQUANT(weight) + bias, ANTIQUANT(weight) = (weight + antiquant_offset) *
    antiquant_scale (aclnnWeightQuantBatchMatmulV2's formula), per channel or, with
    `antiquant_group_size`, per group of that many rows of the [K, N] weight. An int32 weight
    carries int4 (unpacked as `unpack_int4`). The page does not state the precision of the
    dequantized weight or of the accumulation: the emulation dequantizes and accumulates in fp32
    and rounds once, to x's dtype (the conformance row checks a device against that within two
    units in the last place). Not emulated: quant_scale /
    quant_offset (the int8 output). Constraints: `op_rules_int4.check_weight_quant_batchmatmul`."""
    op = "npu_weight_quant_batchmatmul"
    require_same_device(op, x=x, weight=weight, antiquant_scale=antiquant_scale,
                        antiquant_offset=antiquant_offset, bias=bias)
    op_rules_int4.check_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, quant_scale,
                                            quant_offset, bias, antiquant_group_size)
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(f"{op}: quant_scale / quant_offset (int8 output) are not emulated")
    w = unpack_int4(weight) if weight.dtype == torch.int32 else weight
    k = w.shape[0]
    scale = antiquant_scale.reshape(-1, w.shape[1]) if antiquant_scale.dim() == 2 else antiquant_scale.reshape(1, -1)
    offset = None
    if antiquant_offset is not None:
        offset = antiquant_offset.reshape(-1, w.shape[1]) if antiquant_offset.dim() == 2 else antiquant_offset.reshape(1, -1)
    if antiquant_group_size:
        scale = scale.repeat_interleave(antiquant_group_size, dim=0)[:k]
        if offset is not None:
            offset = offset.repeat_interleave(antiquant_group_size, dim=0)[:k]
    wf = w.float()
    if offset is not None:
        wf = wf + offset.float()
    y = x.float() @ (wf * scale.float())
    if bias is not None:
        y = y + bias.float().reshape(-1)
    return y.to(x.dtype)


# the ops the emulation installs on its torch_npu module (kernels/emulation.py)
TORCH_NPU_OPS = {
    "npu_convert_weight_to_int4pack": npu_convert_weight_to_int4pack,
    "npu_weight_quant_batchmatmul": npu_weight_quant_batchmatmul,
}


def convert_weight_to_int4pack(values: torch.Tensor) -> torch.Tensor:
    """int32 [d0, d1] int4 values -> the packed int32 [d0, d1 / 8] the layer holds: the device op
    on an NPU (whatever its nibble order is), the emulation's `npu_convert_weight_to_int4pack`
    elsewhere (its rules checked too)."""
    if values.device.type == "npu":
        import torch_npu  # noqa: F401  (real torch_npu on an NPU node)

        return torch_npu.npu_convert_weight_to_int4pack(values.contiguous())
    return npu_convert_weight_to_int4pack(values.contiguous())
