"""The torch_npu ops vllm-ascend's W4A8_DYNAMIC fused-MoE layers call beyond the W8A8 ones,
emulated for NPU-free runs (`AscendW4A8DynamicFusedMoEMethod`, ModelSlim's original per-group
layout; the semantics of the weights are `kernels.int4`'s staged quantization):

- `npu_quantize(..., dtype=torch.quint4x2, div_mode=False)`: its post-processing packs the
  experts' int4 values (held in int8) into int32, 8 per word along the last dim ("输出tensor类型
  为int32，由8个int4拼接"; torch_npu's npu_quantize page). The page gives neither the nibble order
  nor the rounding: the emulation packs as `int4.pack_int4` (element 8j+i in bits 4i..4i+3, as
  `npu_convert_weight_to_int4pack`'s emulation) and rounds half to even with saturation to
  [-8, 7], as `reference.npu_quantize` does for qint8. vllm-ascend calls it on values that are
  already integers in range (scale 1.0), where only the nibble order matters;
- `npu_grouped_matmul` in its A8W4 form (CANN's aclnnGroupedMatmulV4 page, "伪量化-A8W4"; the
  torch_npu page lists int4 weights for a Tensor group_list but not this row): int8 x [M, K],
  int4 weight [E, K, N] (int32 [E, K, N / 8]), a uint64 scale [E, K / 256, N] holding the
  per-group and per-channel scales fused offline, the precomputed bias [E, N] and a per-token
  scale [M]: for expert i (group_list read as counts: the page says the op assumes
  group_list_type 1 whatever is passed)

      y_i = ((x_i - 8) @ (weight_i * scale_i) + bias_i) * per_token_scale_i

  with scale_i expanded over its 256 rows of K. The bias is the page's offline auxiliary
  8 * sum_k(weight * scale), so a correct one cancels the -8 (y = x @ (w * s) * pts) and a stale
  one does not. The uint64 scale carries an fp32 bit pattern in its low 32 bits
  (npu_trans_quant_param's page: "将float32数据按照bit位存储进一个int64数据里"); high bits set are
  refused as not emulated. The page does not state the accumulation precision: the emulation
  sums the integer products exactly (float64) per group of K, scales in float64 and rounds once
  to the output dtype.

Every other call goes to the W8A8 emulation (`reference.npu_quantize`,
`moe_reference.npu_grouped_matmul`). Constraints: `op_rules.check_quantize`,
`op_rules_int4.check_grouped_matmul_a8w4`. Not verified on hardware: `npu-flashrl verify --kernels`
on an Atlas A2 / A3 node compares both against this module (docs/w4a8.md).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from npu_flashrl.kernels import moe_reference, op_rules, op_rules_int4, reference
from npu_flashrl.kernels.int4 import INT4_MAX, INT4_MIN, pack_int4, unpack_int4
from npu_flashrl.kernels.reference import require_same_device

UINT64_LOW32 = 0xFFFFFFFF


def npu_quantize(x: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor],
                 dtype: torch.dtype, axis: int = 1, div_mode: bool = True) -> torch.Tensor:
    """torch_npu.npu_quantize; with dtype torch.quint4x2 (div_mode False): x * scales
    (+ zero_points) in fp32, rounded half to even, saturated to [-8, 7], packed 8 per int32 along
    the last dim (output shape x.shape[:-1] + (x.shape[-1] / 8,)). Other dtypes: the W8A8
    emulation (`reference.npu_quantize`)."""
    if dtype != torch.quint4x2:
        return reference.npu_quantize(x, scales, zero_points, dtype, axis, div_mode)
    require_same_device("npu_quantize", x=x, scales=scales, zero_points=zero_points)
    op_rules.check_quantize(x, scales, zero_points, dtype, axis, div_mode)
    ax = axis % x.dim()
    y = x.float() * reference._broadcast_along(scales.float(), x, ax)
    if zero_points is not None:
        y = y + reference._broadcast_along(zero_points.float(), x, ax)
    return pack_int4(torch.round(y).clamp_(INT4_MIN, INT4_MAX).to(torch.int8))


def decode_uint64_scale(scale: torch.Tensor, op: str = "npu_grouped_matmul") -> torch.Tensor:
    """The fp32 values of a uint64 quantization scale (fp32 bits in the low 32 bits)."""
    if bool(((scale >> 32) != 0).any()):
        raise NotImplementedError(f"{op}: a uint64 scale with bits set above the low 32 (an offset "
                                  "packed by npu_trans_quant_param) is not emulated")
    return reference.decode_deq_scale(scale & UINT64_LOW32)


def is_a8w4(x, weight) -> bool:
    """An int8 x with an int32 (int4-carrying) weight: the A8W4 form of npu_grouped_matmul."""
    return (isinstance(x, (list, tuple)) and len(x) >= 1 and isinstance(x[0], torch.Tensor)
            and x[0].dtype == torch.int8 and isinstance(weight, (list, tuple)) and len(weight) >= 1
            and isinstance(weight[0], torch.Tensor) and weight[0].dtype == torch.int32)


def grouped_matmul_a8w4(x: List[torch.Tensor], weight: List[torch.Tensor], *, bias, scale, offset,
                        per_token_scale, group_list, split_item: int, group_type, act_type: int,
                        output_dtype) -> List[torch.Tensor]:
    """npu_grouped_matmul's A8W4 form (module docstring)."""
    op = "npu_grouped_matmul"
    operands = {"x": x[0], "weight": weight[0], "group_list": group_list}
    for name, lst in (("bias", bias), ("scale", scale), ("per_token_scale", per_token_scale)):
        for i, t in enumerate(lst or []):
            operands[f"{name}[{i}]"] = t
    require_same_device(op, **operands)
    op_rules_int4.check_grouped_matmul_a8w4(x, weight, bias, scale, offset, per_token_scale, group_list,
                                       split_item, group_type, act_type, output_dtype)
    xs, w = x[0], unpack_int4(weight[0])  # [M, K], [E, K, N]
    s = decode_uint64_scale(scale[0], op)  # [E, G, N]
    b, pts = bias[0], per_token_scale[0]
    m, k = xs.shape
    e, _, n = w.shape
    per = k // s.shape[1]
    out = torch.zeros((m, n), dtype=output_dtype, device=xs.device)
    start = 0
    for g, count in enumerate(int(v) for v in group_list.tolist()):
        rows = slice(start, start + count)
        start += count
        if count == 0:
            continue
        xg = (xs[rows].double() - 8).reshape(count, k // per, per)  # [m, G, per]
        wg = w[g].double().reshape(k // per, per, n)  # [G, per, n]
        acc = torch.einsum("mgp,gpn->mgn", xg, wg)  # exact integer sums per group of K
        y = (acc * s[g].double().unsqueeze(0)).sum(dim=1) + b[g].double()
        out[rows] = (y * pts[rows].double().unsqueeze(-1)).to(output_dtype)
    return [out]


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item: int = 0, group_type=None,
                       group_list_type: int = 0, act_type: int = 0, output_dtype=None,
                       tuning_config=None) -> List[torch.Tensor]:
    """torch_npu.npu_grouped_matmul: the A8W4 form here (an int8 x with an int32 weight; the
    op reads group_list as counts whatever `group_list_type` says), every other form the W8A8
    emulation's (`moe_reference.npu_grouped_matmul`)."""
    if is_a8w4(x, weight):
        for name, v in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset),
                        ("activation_input", activation_input),
                        ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset)):
            op_rules.require(not v, "npu_grouped_matmul", name, "is not assigned in the A8W4 scenario",
                             "npu_grouped_matmul@A8W4")
        return grouped_matmul_a8w4(x, weight, bias=bias, scale=scale, offset=offset,
                                   per_token_scale=per_token_scale, group_list=group_list,
                                   split_item=split_item, group_type=group_type, act_type=act_type,
                                   output_dtype=output_dtype)
    return moe_reference.npu_grouped_matmul(
        x, weight, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, group_list=group_list,
        activation_input=activation_input, activation_quant_scale=activation_quant_scale,
        activation_quant_offset=activation_quant_offset, split_item=split_item,
        group_type=group_type, group_list_type=group_list_type, act_type=act_type,
        output_dtype=output_dtype, tuning_config=tuning_config)


# the ops the emulation installs on its torch_npu module (kernels/emulation.py): these two
# replace the W8A8-only entries and hand every non-int4 call to them
TORCH_NPU_OPS = {
    "npu_quantize": npu_quantize,
    "npu_grouped_matmul": npu_grouped_matmul,
}
