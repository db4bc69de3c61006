"""The documented constraints of the int4 ops the W4A8 emulation provides (`kernels/int4.py`,
`kernels/int4_moe.py`): the same contract as `op_rules` (each rule cited beside it, `DOC[...]`,
an `OpRuleError` naming the op, the argument, the rule and the page), split from it by scheme.
Importing this module adds its pages to `op_rules.DOC`.
"""
from __future__ import annotations

import torch

from npu_flashrl.kernels.op_rules import (BF16, DOC, F16, F32, GMM_INNER_LIMIT, I32, I64, I8, _CANN, _OP_PLUGIN,
                                          _name, refuse, require, require_dtype)

# =========================================================================== W4A8 (int4) ops
# vllm-ascend's W4A8_DYNAMIC linear layers: the weight packed by npu_convert_weight_to_int4pack
# at load, the forward by npu_weight_quant_batchmatmul with antiquant_group_size (its
# activations are not quantized on that path). Emulated in `kernels/int4.py`.

_PTA = "https://www.hiascend.com/document/detail/zh/Pytorch/{}/apiref/apilist/{}.html"
DOC.update({
    "npu_convert_weight_to_int4pack": _PTA.format("600", "ptaoplist_000846"),
    "npu_convert_weight_to_int4pack@aclnn": _CANN.format("82RC1alpha003", "aclnnConvertWeightToINT4Pack"),
    "npu_weight_quant_batchmatmul": _PTA.format("700", "ptaoplist_000179"),
    # the per-group antiquant shape and the antiquant_offset dtype rule, as 6.0.RC3 words them
    "npu_weight_quant_batchmatmul@6.0.RC3": _PTA.format("60RC3", "ptaoplist_000772"),
})
INT4_PACK = 8  # "每8个int4数据通过一个int32数据承载"


def check_convert_weight_to_int4pack(weight, inner_k_tiles) -> None:
    op = "npu_convert_weight_to_int4pack"
    # weight: INT32, 2-D (k, n) or (n, k), contiguous, last dim 8-aligned, values in [-8, 7]
    require_dtype(weight, (I32,), op, "weight")
    require(weight.dim() == 2, op, "weight", f"must be 2-D, got shape {tuple(weight.shape)}")
    # aclnn: "传入空tensor场景" is an ACLNN_ERR_PARAM_INVALID
    require(weight.numel() > 0, op, "weight", "must not be empty", "npu_convert_weight_to_int4pack@aclnn")
    require(weight.is_contiguous(), op, "weight", "must be contiguous (不支持非连续的Tensor)")
    require(weight.shape[-1] % INT4_PACK == 0, op, "weight",
            f"last dim must be a multiple of {INT4_PACK}, got shape {tuple(weight.shape)}")
    if weight.device.type != "meta":
        lo, hi = int(weight.min()), int(weight.max())
        require(-8 <= lo and hi <= 7, op, "weight",
                f"values must be in the int4 range [-8, 7], got [{lo}, {hi}]")
    require(isinstance(inner_k_tiles, int) and inner_k_tiles == 0, op, "inner_k_tiles",
            f"is reserved (default 0, unused), got {inner_k_tiles!r}")


def check_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, quant_scale, quant_offset,
                                   bias, antiquant_group_size) -> None:
    op = "npu_weight_quant_batchmatmul"
    # x: float16 / bfloat16 on A2 / A3, 2-D (M, K)
    require_dtype(x, (F16, BF16), op, "x")
    require(x.dim() == 2, op, "x", f"must be 2-D (M, K), got shape {tuple(x.shape)}")
    # weight: int8, or int32 carrying int4 (npu_convert_weight_to_int4pack), 2-D (K, N)
    require_dtype(weight, (I8, I32), op, "weight", why=" (int32 carries packed int4)")
    require(weight.dim() == 2, op, "weight", f"must be 2-D (K, N), got shape {tuple(weight.shape)}")
    k = x.shape[1]
    n = weight.shape[1] * (INT4_PACK if weight.dtype == I32 else 1)
    require(weight.shape[0] == k, op, "weight", f"its K ({weight.shape[0]}) must equal x's K ({k})")
    require(isinstance(antiquant_group_size, int) and antiquant_group_size >= 0, op, "antiquant_group_size",
            f"must be a non-negative int, got {antiquant_group_size!r}")
    # antiquant_scale: float16 / bfloat16 equal to x's dtype (int64: per-channel only, fp16 x,
    # int8 weight); (1, N), (N,), (1,), or (ceil_div(K, antiquant_group_size), N) per group
    require_dtype(antiquant_scale, (F16, BF16, I64), op, "antiquant_scale")
    if antiquant_scale.dtype == I64:
        require(x.dtype == F16 and weight.dtype == I8 and not antiquant_group_size, op, "antiquant_scale",
                "an int64 scale needs a float16 x, an int8 weight and the per-channel mode")
    else:
        require(antiquant_scale.dtype == x.dtype, op, "antiquant_scale",
                f"dtype must equal x's ({_name(x.dtype)}), got {_name(antiquant_scale.dtype)}")
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        ok = (groups, n)
        require(tuple(antiquant_scale.shape) == ok, op, "antiquant_scale",
                f"must be (ceil_div(K, antiquant_group_size), N) = {ok} per group, got "
                f"{tuple(antiquant_scale.shape)}", "npu_weight_quant_batchmatmul@6.0.RC3")
    else:
        ok_shapes = ((1, n), (n,), (1,))
        require(tuple(antiquant_scale.shape) in ok_shapes, op, "antiquant_scale",
                f"must be one of {ok_shapes} per channel / tensor, got {tuple(antiquant_scale.shape)}")
    if antiquant_offset is not None:
        # float16 / bfloat16 equal to antiquant_scale's dtype, or int32
        if antiquant_offset.dtype != I32:
            require(antiquant_offset.dtype == antiquant_scale.dtype, op, "antiquant_offset",
                    f"dtype must equal antiquant_scale's ({_name(antiquant_scale.dtype)}) or be int32, got "
                    f"{_name(antiquant_offset.dtype)}", "npu_weight_quant_batchmatmul@6.0.RC3")
        require(tuple(antiquant_offset.shape) == tuple(antiquant_scale.shape), op, "antiquant_offset",
                f"must have antiquant_scale's shape {tuple(antiquant_scale.shape)}, got "
                f"{tuple(antiquant_offset.shape)}", "npu_weight_quant_batchmatmul@6.0.RC3")
    if bias is not None:
        require_dtype(bias, (F16, F32), op, "bias")
        require(tuple(bias.shape) in ((1, n), (n,)), op, "bias", f"must be (1, N) or (N,) with N={n}, "
                f"got {tuple(bias.shape)}")


# =========================================================================== W4A8 fused MoE
# vllm-ascend's W4A8_DYNAMIC fused-MoE layers (`AscendW4A8DynamicFusedMoEMethod`, ModelSlim's
# original per-group layout): the experts packed by npu_quantize(dtype=quint4x2) at load (rules in
# `check_quantize` above), the forward by npu_grouped_matmul in its A8W4 form (int8 x, int4 weight,
# a uint64 per-group scale and the precomputed bias). The torch_npu page lists int4 weights for a
# Tensor group_list but not the A8W4 row; the aclnn page of the kernel it calls does (below).
# Emulated in `kernels/int4_moe.py`.

DOC.update({
    "npu_grouped_matmul@A8W4":
        "https://gitcode.com/cann/ops-transformer/blob/master/gmm/grouped_matmul/docs/aclnnGroupedMatmulV4.md",
    # how a float scale travels as the uint64 / int64 quantization parameter (low 32 bits)
    "npu_trans_quant_param": _OP_PLUGIN.format("npu_trans_quant_param"),
})
A8W4_QUANT_GROUP = 256  # "当前支持quantGroupSize=256"
A8W4_MAX_K = 18432  # "k <= 18432"
A8W4_N_ALIGN = 8  # "要求n为8的整数倍"
A8W4_MAX_GROUPS = 1024  # groupType 0, single x / weight / y: "最多支持1024个group"


def check_grouped_matmul_a8w4(x, weight, bias, scale, offset, per_token_scale, group_list,
                              split_item: int, group_type, act_type: int, output_dtype) -> None:
    """The A8W4 row of aclnnGroupedMatmulV4 (Atlas A2 / A3), symmetric (offset null): single
    tensors, x int8 (M, K), weight int4 (E, K, N) not transposed (int32 carrying 8 int4 each),
    bias FLOAT [E, N] (required: the offline 8 * sum_k(weight * scale)), scale UINT64
    [E, K / 256, N] (per-group and per-channel fused offline), per_token_scale FLOAT [M], output
    BFLOAT16 (FLOAT16 with the same inputs), groupType 0, actType 0, K a multiple of 256 and at
    most 18432, N a multiple of 8."""
    op, doc = "npu_grouped_matmul", "npu_grouped_matmul@A8W4"

    def one(lst, arg):
        require(isinstance(lst, (list, tuple)) and len(lst) == 1 and isinstance(lst[0], torch.Tensor),
                op, arg, "must be a list of exactly one tensor in the A8W4 scenario "
                "(x, weight, y single tensors)", doc)
        return lst[0]

    xs, w = one(x, "x"), one(weight, "weight")
    require(xs.dtype == I8 and xs.dim() == 2, op, "x", f"must be int8 (M, K) in the A8W4 scenario, got "
            f"{_name(xs.dtype)} {tuple(xs.shape)}", doc)
    require(w.dtype == I32 and w.dim() == 3, op, "weight", "must be 3-D (E, K, N) int4, carried as int32 "
            f"(E, K, N / 8), got {_name(w.dtype)} {tuple(w.shape)}", doc)
    require(w.is_contiguous(), op, "weight", "must not be transposed in the A8W4 scenario", doc)
    e, k, n = w.shape[0], w.shape[1], w.shape[2] * 8
    m = xs.shape[0]
    require(xs.shape[1] == k, op, "weight", f"its K ({k}) must equal x's K ({xs.shape[1]})", doc)
    require(group_type == 0 and act_type == 0, op, "group_type/act_type",
            f"must be 0 / 0 in the A8W4 scenario, got {group_type} / {act_type}", doc)
    require(split_item in (2, 3), op, "split_item", f"must be 2 or 3 (one output tensor), got {split_item}", doc)
    require(offset is None, op, "offset", "asymmetric A8W4 (offset set) is not emulated; pass None", doc)
    require(k % A8W4_QUANT_GROUP == 0 and k <= A8W4_MAX_K, op, "x", f"K={k} must be a multiple of "
            f"quantGroupSize {A8W4_QUANT_GROUP} and at most {A8W4_MAX_K} (offset null)", doc)
    require(n % A8W4_N_ALIGN == 0, op, "weight", f"N={n} must be a multiple of {A8W4_N_ALIGN}", doc)
    require(bias is not None, op, "bias", "is required in the A8W4 scenario (the offline "
            "8 * weight * scale summed over K)", doc)
    b = one(bias, "bias")
    require(b.dtype == F32 and tuple(b.shape) == (e, n), op, "bias",
            f"is required: float32 [E={e}, N={n}] (8 * weight * scale summed over K), got "
            f"{_name(b.dtype)} {tuple(b.shape)}", doc)
    s = one(scale, "scale")
    groups = k // A8W4_QUANT_GROUP
    require(s.dtype == I64 and tuple(s.shape) == (e, groups, n), op, "scale",
            f"must be uint64 (torch int64) [E={e}, K/{A8W4_QUANT_GROUP}={groups}, N={n}], got "
            f"{_name(s.dtype)} {tuple(s.shape)}", doc)
    p = one(per_token_scale, "per_token_scale")
    require(p.dtype == F32 and tuple(p.shape) == (m,), op, "per_token_scale",
            f"must be float32 [M={m}], got {_name(p.dtype)} {tuple(p.shape)}", doc)
    require(output_dtype in (BF16, F16), op, "output_dtype",
            f"must be bfloat16 or float16 in the A8W4 scenario, got {_name(output_dtype)}", doc)
    require(isinstance(group_list, torch.Tensor) and group_list.dtype == I64 and group_list.dim() == 1
            and group_list.numel() == e, op, "group_list",
            f"must be a 1-D int64 Tensor with one entry per expert ({e})", doc)
    require(e <= A8W4_MAX_GROUPS, op, "group_list", f"at most {A8W4_MAX_GROUPS} groups, got {e}", doc)
    vals = [int(v) for v in group_list.tolist()]
    # "仅支持groupListType为1（算子不会检查groupListType的值，会认为groupListType为1）": counts
    require(all(v >= 0 for v in vals), op, "group_list", f"counts must be non-negative, got {vals}", doc)
    # torch_npu's page: "数值的总和与x中tensor的第一维相等"
    require(sum(vals) == m, op, "group_list", f"its sum ({sum(vals)}) must equal x's first dim M={m} "
            "(the A8W4 op reads group_list as counts whatever group_list_type says)")
    require(xs.shape[-1] < GMM_INNER_LIMIT and n < GMM_INNER_LIMIT, op, "x/weight",
            f"last dims must be below InnerLimit {GMM_INNER_LIMIT}")
