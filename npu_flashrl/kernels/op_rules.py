"""The documented constraints of the torch_npu / CANN ops the CPU emulation provides.

Every check here is a rule from Huawei's torch_npu API reference (Ascend op-plugin
`docs/context/torch_npu-<op>.md`, mirrored on hiascend.com as the "Ascend Extension for PyTorch"
API list) or from the CANN aclnn op page, cited beside the rule (`DOC[...]`). The emulated ops call
these before computing, so a call that the NPU op would reject fails on the CPU too, with an
`OpRuleError` naming the op, the argument, the rule and the page. Rules are those of the Atlas A2
and A3 products (the two NPUs npu_flashrl targets; where A2 and A3 differ, or a release changed a
rule, the comment says which). Modes the docs allow but the emulation does not compute raise
NotImplementedError in the kernels instead (`_not_emulated`).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from npu_flashrl.errors import NpuFlashrlError

_OP_PLUGIN = "https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-{}.md"
_CANN = "https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/{}/API/aolapi/context/{}.md"

# The page each op's rules come from (torch_npu API reference unless named otherwise).
DOC = {
    "npu_quant_matmul": _OP_PLUGIN.format("npu_quant_matmul"),
    "npu_quantize": _OP_PLUGIN.format("npu_quantize"),
    "npu_dynamic_quant": _OP_PLUGIN.format("npu_dynamic_quant"),
    # the A2 row-length limit of npu_dynamic_quant, listed up to Ascend Extension for PyTorch 6.0.RC3
    "npu_dynamic_quant@6.0.RC3":
        "https://www.hiascend.com/document/detail/zh/Pytorch/60RC3/apiref/apilist/ptaoplist_000784.html",
    "npu_grouped_matmul": _OP_PLUGIN.format("npu_grouped_matmul"),
    "npu_grouped_matmul_swiglu_quant": _OP_PLUGIN.format("npu_grouped_matmul_swiglu_quant"),
    "npu_moe_init_routing_v2": _OP_PLUGIN.format("npu_moe_init_routing_v2"),
    "npu_moe_token_unpermute": _CANN.format("82RC1alpha002", "aclnnMoeTokenUnpermute"),
    "npu_dequant_swiglu_quant": _OP_PLUGIN.format("npu_dequant_swiglu_quant"),
    "npu_moe_gating_top_k": _OP_PLUGIN.format("npu_moe_gating_top_k"),
    # the expert-count limit as CANN 8.3 lifted it (torch_npu 7.0.0's page: exactly 256 experts)
    "npu_moe_gating_top_k@aclnn": _CANN.format("83RC1", "aclnnMoeGatingTopK"),
    "npu_moe_gating_top_k_softmax": _OP_PLUGIN.format("npu_moe_gating_top_k_softmax"),
    "npu_swiglu": _OP_PLUGIN.format("npu_swiglu"),
    "npu_format_cast": _OP_PLUGIN.format("npu_format_cast"),
    "get_npu_format": _OP_PLUGIN.format("get_npu_format"),
    # the shared experts' path of the current line's vllm-ascend (see the "DeepSeek shared experts" block below)
    "npu_quant_matmul@int32": _OP_PLUGIN.format("npu_quant_matmul"),
    "_C_ascend.npu_dequant_swiglu_quant":
        "https://gitcode.com/cann/ops-nn/blob/master/quant/dequant_swiglu_quant/docs/aclnnDequantSwigluQuantV2.md",
    "_C_ascend.npu_dequant_swiglu_quant@vllm-ascend":
        "https://github.com/vllm-project/vllm-ascend/blob/v0.23.0/csrc/torch_binding.cpp",
}


class OpRuleError(NpuFlashrlError, ValueError):
    """An input the documented NPU op rejects."""


def qualified(op: str) -> str:
    """torch_npu.<op>, or vllm-ascend's compiled torch.ops._C_ascend.<op> (an `_C_ascend.` prefix
    names vllm-ascend's op where torch_npu has one of the same name)."""
    if op.startswith("_C_ascend."):
        return f"torch.ops.{op}"
    return f"torch_npu.{op}" if op.startswith(("npu_", "get_npu")) else f"torch.ops._C_ascend.{op}"


def refuse(op: str, arg: str, rule: str, doc_key: Optional[str] = None) -> OpRuleError:
    return OpRuleError(f"{qualified(op)}: {arg}: {rule} (documented: {DOC[doc_key or op]})")


def require(cond: bool, op: str, arg: str, rule: str, doc_key: Optional[str] = None) -> None:
    if not cond:
        raise refuse(op, arg, rule, doc_key)


def _name(d) -> str:
    return "None" if d is None else str(d).replace("torch.", "")


def dtype_of(t) -> Optional[torch.dtype]:
    return t.dtype if isinstance(t, torch.Tensor) else None


def require_dtype(t, allowed: Iterable, op: str, arg: str, doc_key: Optional[str] = None,
                  why: str = "") -> None:
    allowed = tuple(allowed)
    d = dtype_of(t)
    require(d in allowed, op, arg,
            f"dtype must be one of {', '.join(_name(a) for a in allowed)}{why}, got {_name(d)}",
            doc_key)


# --------------------------------------------------------------------------- npu_quant_matmul

# "x1与x2最后一维的shape大小不能超过65535" (constraints section)
QUANT_MATMUL_MAX_LAST_DIM = 65535
I8, I32, I64 = torch.int8, torch.int32, torch.int64
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# Table 2 ("Atlas A2 / A3") of the data type combinations, int8 x1 / x2 rows:
# (output_dtype, scale, offset, bias, pertoken_scale)
QUANT_MATMUL_COMBOS = (
    (F16, (I64, F32), (None,), (I32, None), (None,)),
    (I8, (I64, F32), (F32, None), (I32, None), (None,)),
    (BF16, (F32, BF16), (None,), (I32, BF16, F32, None), (F32, None)),
    (F16, (F32,), (None,), (I32, BF16, F32, None), (F32,)),
    (I32, (F32, BF16), (None,), (I32, None), (None,)),
)


def check_quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype) -> None:
    op = "npu_quant_matmul"
    # x1 / x2: int8 (int32 = packed int4, not emulated), 2-6 dims, same dtype
    require_dtype(x1, (I8,), op, "x1", why=" (int32-packed int4 is not emulated)")
    require(x2.dtype == x1.dtype, op, "x2", f"dtype must equal x1's ({_name(x1.dtype)}), got {_name(x2.dtype)}")
    require(2 <= x1.dim() <= 6, op, "x1", f"must have 2-6 dims, got shape {tuple(x1.shape)}")
    require(2 <= x2.dim() <= 6, op, "x2", f"must have 2-6 dims, got shape {tuple(x2.shape)}")
    k, n = x2.shape[-2], x2.shape[-1]
    require(x1.shape[-1] == k, op, "x1", f"last dim {x1.shape[-1]} must equal x2's k={k}")
    require(x1.shape[-1] <= QUANT_MATMUL_MAX_LAST_DIM and n <= QUANT_MATMUL_MAX_LAST_DIM, op, "x1/x2",
            f"last dims must not exceed {QUANT_MATMUL_MAX_LAST_DIM} (got k={x1.shape[-1]}, n={n}); "
            "do not quantize vocab-sized layers such as lm_head")
    # scale: 1-D (t,), t = 1 or n; float32 / int64 / bfloat16 on A2 and A3
    require_dtype(scale, (F32, I64, BF16), op, "scale")
    require(scale.dim() == 1 and scale.shape[0] in (1, n), op, "scale",
            f"must be 1-D (t,) with t = 1 or n = {n}, got shape {tuple(scale.shape)}")
    if offset is not None:
        require_dtype(offset, (F32,), op, "offset")
        require(offset.dim() == 1 and offset.shape[0] in (1, n), op, "offset",
                f"must be 1-D (t,) with t = 1 or n = {n}, got shape {tuple(offset.shape)}")
    if pertoken_scale is not None:
        require_dtype(pertoken_scale, (F32,), op, "pertoken_scale")
        m = x1.shape[-2]
        require(pertoken_scale.dim() == 1 and pertoken_scale.shape[0] == m, op, "pertoken_scale",
                f"must be 1-D (m,) with m = x1's m = {m}, got shape {tuple(pertoken_scale.shape)}")
    if bias is not None:
        require(tuple(bias.shape) == (n,) or (bias.dim() == 3 and bias.shape[1:] == (1, n)), op, "bias",
                f"must be (n,) = ({n},) or (batch, 1, {n}), got shape {tuple(bias.shape)}")
    # output_dtype None means int8 output; float32 is not an output type
    out = I8 if output_dtype is None else output_dtype
    require(out in (I8, F16, BF16, I32), op, "output_dtype",
            f"must be None/int8, float16, bfloat16 or int32, got {_name(output_dtype)}")
    got = (dtype_of(scale), dtype_of(offset), dtype_of(bias), dtype_of(pertoken_scale))
    rows = [r for r in QUANT_MATMUL_COMBOS if r[0] == out]
    if not any(all(g in allowed for g, allowed in zip(got, r[1:])) for r in rows):
        table = "; ".join(
            "scale " + "/".join(map(_name, r[1])) + ", offset " + "/".join(map(_name, r[2]))
            + ", bias " + "/".join(map(_name, r[3])) + ", pertoken_scale " + "/".join(map(_name, r[4]))
            for r in rows)
        raise refuse(op, "scale/offset/bias/pertoken_scale",
                     f"the combination scale {_name(got[0])}, offset {_name(got[1])}, bias {_name(got[2])}, "
                     f"pertoken_scale {_name(got[3])} is not documented for a {_name(out)} output "
                     f"(documented: {table})")


# --------------------------------------------------------------------------- npu_quantize

def check_quantize(x, scales, zero_points, dtype, axis, div_mode) -> None:
    op = "npu_quantize"
    require_dtype(x, (F32, F16, BF16), op, "input")
    if div_mode:
        # div_mode True: scales float32/bfloat16; zero_points int8/uint8/int32/bfloat16;
        # dtype qint8 / quint8 / int32
        require_dtype(scales, (F32, BF16), op, "scales", why=" with div_mode=True")
        if zero_points is not None:
            require_dtype(zero_points, (I8, torch.uint8, I32, BF16), op, "zero_points", why=" with div_mode=True")
        require(dtype in (torch.qint8, torch.quint8, torch.int32), op, "dtype",
                f"must be torch.qint8, torch.quint8 or torch.int32 with div_mode=True, got {dtype}")
    else:
        # div_mode False: scales / zero_points float32/float16/bfloat16, zero_points of the
        # shape and dtype of scales; dtype qint8 (or quint4x2, not emulated); axis >= -2
        require_dtype(scales, (F32, F16, BF16), op, "scales", why=" with div_mode=False")
        if zero_points is not None:
            require(zero_points.dtype == scales.dtype and zero_points.shape == scales.shape, op,
                    "zero_points", f"must have the shape and dtype of scales ({tuple(scales.shape)}, "
                    f"{_name(scales.dtype)}) with div_mode=False, got {tuple(zero_points.shape)}, "
                    f"{_name(zero_points.dtype)}")
        require(dtype in (torch.qint8, torch.quint4x2), op, "dtype",
                f"must be torch.qint8 or torch.quint4x2 with div_mode=False, got {dtype}")
        require(-2 <= axis < x.dim(), op, "axis",
                f"must be in [-2, {x.dim()}) with div_mode=False, got {axis}")
        if dtype == torch.quint4x2:
            # "div_mode为False且dtype为quint4x2时，最后一维需要能被8整除" (8 int4 per int32 output)
            require(x.dim() >= 1 and x.shape[-1] % 8 == 0, op, "input",
                    f"last dim must be a multiple of 8 with dtype=torch.quint4x2, got shape {tuple(x.shape)}")
    ax = axis % x.dim()
    for name, t in (("scales", scales), ("zero_points", zero_points)):
        if t is None:
            continue
        ok = (t.dim() == 1 and t.shape[0] in (1, x.shape[ax])) or (
            t.dim() == x.dim() and all(s == 1 for i, s in enumerate(t.shape) if i != ax)
            and t.shape[ax] in (1, x.shape[ax]))
        require(ok, op, name, f"must be 1-D with 1 or {x.shape[ax]} (input.shape[{axis}]) elements, or "
                f"input's rank with 1 outside axis {axis}; got shape {tuple(t.shape)}")


# --------------------------------------------------------------------------- npu_dynamic_quant

# Listed for Atlas A2 up to Ascend Extension for PyTorch 6.0.RC3 ("x的最后一个维度大小不超过
# 11264"); no longer listed from 6.0.0. The emulation follows the current page; the weight
# quantizer on a real NPU stays within it on every release (kernels/npu.py).
DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3 = 11264


def check_dynamic_quant(x, smooth_scales, group_index, dst_type) -> None:
    op = "npu_dynamic_quant"
    require_dtype(x, (F16, BF16), op, "x")
    require(x.dim() > 1, op, "x", f"must have more than 1 dim, got shape {tuple(x.shape)}")
    require(dst_type in (None, I8, torch.quint4x2), op, "dst_type",
            f"must be None, torch.int8 or torch.quint4x2, got {dst_type}")
    if smooth_scales is not None:
        require_dtype(smooth_scales, (F16, BF16), op, "smooth_scales")
        # "单算子模式：smooth_scales的dtype必须和x保持一致"
        require(smooth_scales.dtype == x.dtype, op, "smooth_scales",
                f"dtype must equal x's ({_name(x.dtype)}), got {_name(smooth_scales.dtype)}")
        if group_index is None:
            require(tuple(smooth_scales.shape) == (x.shape[-1],), op, "smooth_scales",
                    f"must be 1-D with x's last dim ({x.shape[-1]}) elements, got {tuple(smooth_scales.shape)}")
    if group_index is not None:
        require_dtype(group_index, (I32,), op, "group_index")


# --------------------------------------------------------------------------- npu_grouped_matmul

GMM_INNER_LIMIT = 65536  # "内轴限制InnerLimit为65536": last dims of x and weight below it
GMM_MAX_GROUPS_3D = 1024  # group_type 0, single x / weight / y: "最多支持1024个group"
GMM_MAX_LIST = 128  # tensor lists and count-type group_list of a weight list: at most 128


def check_grouped_matmul(xs, ws: Sequence[torch.Tensor], weight_is_3d: bool, bias, scale,
                         per_token_scale, group_list, group_list_type: int,
                         output_dtype) -> None:
    """The m-axis grouped (group_type 0) single-x, single-y form, with group_list a Tensor."""
    op = "npu_grouped_matmul"
    require(isinstance(group_list, torch.Tensor), op, "group_list",
            "must be a Tensor for group_type 0 with group_list_type (a List[int] group_list takes "
            "neither, and is not emulated)")
    require_dtype(group_list, (I64,), op, "group_list")
    require(group_list.dim() == 1 and group_list.numel() == len(ws), op, "group_list",
            f"must be 1-D with one entry per weight ({len(ws)}), got shape {tuple(group_list.shape)}")
    if weight_is_3d:
        require(len(ws) <= GMM_MAX_GROUPS_3D, op, "group_list", f"at most {GMM_MAX_GROUPS_3D} groups, got {len(ws)}")
    else:
        require(len(ws) <= GMM_MAX_LIST, op, "weight", f"at most {GMM_MAX_LIST} tensors, got {len(ws)}")
    vals = [int(v) for v in group_list.tolist()]
    m = xs.shape[0]
    if group_list_type == 0:
        require(all(v >= 0 for v in vals) and all(a <= b for a, b in zip(vals, vals[1:])), op, "group_list",
                f"a cumsum group_list (group_list_type 0) must be non-negative and non-decreasing, got {vals}")
        # "当group_list_type为0时，最后一个值与x中tensor的第一维相等"
        require(vals[-1] == m, op, "group_list",
                f"its last value ({vals[-1]}) must equal x's first dim M={m} (group_list_type 0)")
    elif group_list_type == 1:
        require(all(v >= 0 for v in vals), op, "group_list", f"counts must be non-negative, got {vals}")
        require(len(vals) != 1, op, "group_list", "a count group_list (group_list_type 1) must not have length 1")
        # "当group_list_type为1时，数值的总和与x中tensor的第一维相等"
        require(sum(vals) == m, op, "group_list",
                f"its sum ({sum(vals)}) must equal x's first dim M={m} (group_list_type 1)")
    require(xs.shape[-1] < GMM_INNER_LIMIT and all(w.shape[-1] < GMM_INNER_LIMIT for w in ws), op,
            "x/weight", f"last dims must be below InnerLimit {GMM_INNER_LIMIT}")
    # Table 2 (group_list a Tensor, Atlas A2 / A3), the int8 and float rows
    bias_dt = dtype_of(bias[0]) if bias else None
    scale_dt = dtype_of(scale[0]) if scale else None
    if xs.dtype == I8:
        require(all(w.dtype == I8 for w in ws), op, "weight", "int8 x needs int8 weights (int4 is not emulated)")
        require(bias_dt in (I32, None), op, "bias",
                f"dtype must be int32 for an int8 x (the quantized rows of table 2), got {_name(bias_dt)}")
        if per_token_scale is not None:
            require_dtype(per_token_scale[0], (F32,), op, "per_token_scale")
        if scale_dt is None:
            # no scale: the int32 accumulator (the int8 -> int32 row of the tuning_config table,
            # the form vllm-ascend's W8A8_DYNAMIC MoE uses before npu_dequant_swiglu_quant)
            require(output_dtype == I32 and per_token_scale is None, op, "output_dtype",
                    f"an int8 x without scale gives the int32 accumulator: output_dtype must be int32 "
                    f"and per_token_scale None, got {_name(output_dtype)}")
            return
        # perchannel / pertoken rows: bfloat16 scale -> bfloat16 y, float32 scale -> float16 y,
        # int64 scale -> int8 y (perchannel only)
        out_for = {BF16: (BF16,), F32: (F16,), I64: (I8, None)}
        require(scale_dt in out_for, op, "scale",
                f"dtype must be bfloat16, float32 or int64 for an int8 x, got {_name(scale_dt)}")
        require(output_dtype in out_for[scale_dt], op, "output_dtype",
                f"a {_name(scale_dt)} scale gives a {'/'.join(map(_name, out_for[scale_dt]))} output "
                f"(table 2), got output_dtype {_name(output_dtype)}")
        require(not (scale_dt == I64 and per_token_scale is not None), op, "per_token_scale",
                "an int64 scale (perchannel int8 output) takes no per_token_scale")
    else:
        require_dtype(xs, (F16, BF16, F32), op, "x")
        require(all(w.dtype == xs.dtype for w in ws), op, "weight",
                f"a {_name(xs.dtype)} x needs {_name(xs.dtype)} weights (weight-only int8 is not emulated)")
        require(scale is None and per_token_scale is None, op, "scale/per_token_scale",
                "are not assigned in the non-quantized rows")
        bias_for = {F16: F16, BF16: F32, F32: F32}
        require(bias_dt in (None, bias_for[xs.dtype]), op, "bias",
                f"dtype must be {_name(bias_for[xs.dtype])} for a {_name(xs.dtype)} x, got {_name(bias_dt)}")
        require(output_dtype in (None, xs.dtype), op, "output_dtype",
                f"must be None or x's dtype {_name(xs.dtype)}, got {_name(output_dtype)}")


# --------------------------------------------------------------------------- npu_moe_init_routing_v2

INIT_ROUTING_MAX_EXPERTS = 10240  # expert_num in [0, 10240] (5120 in key_value mode)


def check_moe_init_routing_v2(x, expert_idx, scale, offset, active_num, expert_capacity, expert_num,
                              drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag,
                              quant_mode, active_expert_range, row_idx_type) -> None:
    op = "npu_moe_init_routing_v2"
    require_dtype(x, (F16, BF16, F32, I8), op, "x")
    require(x.dim() == 2, op, "x", f"must be 2-D (NUM_ROWS, H), got shape {tuple(x.shape)}")
    require_dtype(expert_idx, (I32,), op, "expert_idx")
    require(expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0], op, "expert_idx",
            f"must be 2-D (NUM_ROWS={x.shape[0]}, K), got shape {tuple(expert_idx.shape)}")
    n, k = expert_idx.shape
    # quant_mode: 0 static (the default, not supported), -1 none, 1 dynamic
    require(quant_mode in (-1, 1), op, "quant_mode",
            f"must be -1 (no quant) or 1 (dynamic); 0 (static, the default) is not supported, got {quant_mode}")
    require(drop_pad_mode == 0, op, "drop_pad_mode", f"only 0 (dropless) is supported, got {drop_pad_mode}")
    require(expert_tokens_num_type in (1, 2), op, "expert_tokens_num_type",
            f"only 1 (count) and 2 (key_value) are supported, got {expert_tokens_num_type}")
    require(expert_tokens_num_flag is True, op, "expert_tokens_num_flag", "only True is supported")
    # "active_num ... 当前未使用，校验需等于NUM_ROWS*K"
    require(active_num == n * k, op, "active_num", f"must equal NUM_ROWS*K = {n * k}, got {active_num}")
    require(expert_capacity is not None and expert_capacity >= -1, op, "expert_capacity",
            f"must be given (unused in dropless mode), got {expert_capacity}")
    top = 5120 if expert_tokens_num_type == 2 else INIT_ROUTING_MAX_EXPERTS
    require(0 <= expert_num <= top, op, "expert_num", f"must be in [0, {top}], got {expert_num}")
    rng = list(active_expert_range)
    require(len(rng) == 2 and 0 <= rng[0] <= rng[1] <= expert_num, op, "active_expert_range",
            f"must be [expert_start, expert_end] with 0 <= start <= end <= expert_num={expert_num}, got {rng}")
    require(row_idx_type in (0, 1), op, "row_idx_type", f"must be 0 (gather) or 1 (scatter), got {row_idx_type}")
    require(offset is None, op, "offset", "is not given in the non-quantized and dynamic-quant modes")
    if scale is not None:
        require_dtype(scale, (F32,), op, "scale")
        if quant_mode == -1:
            require(tuple(scale.shape) == (n,), op, "scale",
                    f"must be 1-D (NUM_ROWS,) = ({n},) without quantization, got {tuple(scale.shape)}")
        else:
            require(tuple(scale.shape) == (rng[1] - rng[0], x.shape[1]), op, "scale",
                    f"must be 2-D (expert_end-expert_start, H) in dynamic quant mode, got {tuple(scale.shape)}")


# --------------------------------------------------------------------------- npu_moe_token_unpermute

def check_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode) -> None:
    op = "npu_moe_token_unpermute"
    require_dtype(permuted_tokens, (BF16, F16, F32), op, "permuted_tokens")
    require_dtype(sorted_indices, (I32,), op, "sorted_indices")
    require(sorted_indices.dim() == 1, op, "sorted_indices", f"must be 1-D, got shape {tuple(sorted_indices.shape)}")
    require(sorted_indices.numel() == permuted_tokens.shape[0], op, "sorted_indices",
            f"must have one entry per permuted token ({permuted_tokens.shape[0]}), got {sorted_indices.numel()}")
    if probs is not None:
        require_dtype(probs, (BF16, F16, F32), op, "probs")
        require(probs.dim() == 2, op, "probs", f"must be 2-D (tokens, topK), got shape {tuple(probs.shape)}")


# --------------------------------------------------------------------------- npu_dequant_swiglu_quant

DEQUANT_SWIGLU_MAX_H = 10496  # with group_index: "H≤10496同时64对齐"
DEQUANT_SWIGLU_H_ALIGN = 64


def check_dequant_swiglu_quant(x, weight_scale, activation_scale, bias, quant_scale, quant_offset,
                               group_index, quant_mode) -> None:
    op = "npu_dequant_swiglu_quant"
    require_dtype(x, (I32, BF16), op, "x")
    require(x.dim() == 2 and x.shape[1] % 2 == 0, op, "x",
            f"must be 2-D [TokensNum, 2H] with an even last dim, got shape {tuple(x.shape)}")
    t, h = x.shape[0], x.shape[1] // 2
    if x.dtype == I32:
        require(weight_scale is not None and activation_scale is not None, op, "weight_scale/activation_scale",
                "an int32 x needs both (it is dequantized)")
    if weight_scale is not None:
        require_dtype(weight_scale, (F32,), op, "weight_scale")
        # the page says 2-D [groupNum, 2H]; its own example passes a 1-D [2H] (accepted as groupNum 1)
        require(weight_scale.shape[-1] == 2 * h and weight_scale.dim() in (1, 2), op, "weight_scale",
                f"must be [groupNum, 2H={2 * h}], got shape {tuple(weight_scale.shape)}")
    if activation_scale is not None:
        require_dtype(activation_scale, (F32,), op, "activation_scale")
        # the page says 1-D [TokensNum]; its own example passes [TokensNum, 1]
        require(activation_scale.numel() == t and activation_scale.shape[0] == t, op, "activation_scale",
                f"must be [TokensNum={t}], got shape {tuple(activation_scale.shape)}")
    if bias is not None:
        require_dtype(bias, (I32,), op, "bias")
    for name, v in (("quant_scale", quant_scale), ("quant_offset", quant_offset)):
        if v is not None:
            require_dtype(v, (F32, F16, BF16), op, name)
    require(quant_mode in (0, 1), op, "quant_mode", f"must be 0 (static) or 1 (dynamic), got {quant_mode}")
    if group_index is not None:
        require_dtype(group_index, (I64,), op, "group_index")
        require(group_index.dim() == 1, op, "group_index", f"must be 1-D, got shape {tuple(group_index.shape)}")
        require(quant_mode == 1, op, "quant_mode", "must be 1 (dynamic) with group_index")
        require(bias is None and quant_offset is None, op, "bias/quant_offset", "must be None with group_index")
        require(h <= DEQUANT_SWIGLU_MAX_H and h % DEQUANT_SWIGLU_H_ALIGN == 0, op, "x",
                f"H={h} must be <= {DEQUANT_SWIGLU_MAX_H} and a multiple of {DEQUANT_SWIGLU_H_ALIGN} with group_index")
        counts = [int(v) for v in group_index.tolist()]
        require(all(c >= 0 for c in counts), op, "group_index", f"counts must be non-negative, got {counts}")
        # "需要网络保证group_index输入的求和不超过x的TokensNum维度，否则会出现越界访问"
        require(sum(counts) <= t, op, "group_index", f"its sum ({sum(counts)}) must not exceed TokensNum={t}")


# --------------------------------------------------------------------------- gating top-k

GATING_MAX_EXPERTS = 2048  # aclnnMoeGatingTopK (CANN 8.3): experts <= 2048


def check_moe_gating_top_k(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type,
                           op: str = "npu_moe_gating_top_k") -> None:
    doc = "npu_moe_gating_top_k"
    require_dtype(x, (F16, BF16, F32), op, "x", doc)
    require(x.dim() == 2, op, "x", f"must be 2-D, got shape {tuple(x.shape)}", doc)
    e = x.shape[-1]
    require(e <= GATING_MAX_EXPERTS, op, "x", f"expert count {e} must not exceed {GATING_MAX_EXPERTS}",
            "npu_moe_gating_top_k@aclnn")
    require(group_count >= 1 and e % group_count == 0, op, "group_count",
            f"must divide the expert count {e}, got {group_count}", "npu_moe_gating_top_k@aclnn")
    require(1 <= k_group <= group_count, op, "k_group", f"must be in [1, group_count={group_count}], got {k_group}", doc)
    top = e // group_count * k_group
    require(1 <= k <= top, op, "k", f"must satisfy 1 <= k <= x.shape[-1] / group_count * k_group = {top}, got {k}", doc)
    if bias is not None:
        require(bias.dtype == x.dtype, op, "bias", f"dtype must equal x's ({_name(x.dtype)}), got {_name(bias.dtype)}", doc)
        require(tuple(bias.shape) == (e,), op, "bias", f"must be 1-D ({e},), got shape {tuple(bias.shape)}", doc)
    require(norm_type in (0, 1), op, "norm_type", f"must be 0 (softmax) or 1 (sigmoid), got {norm_type}",
            "npu_moe_gating_top_k@aclnn")
    require(group_select_mode in (0, 1), op, "group_select_mode", f"must be 0 or 1, got {group_select_mode}",
            "npu_moe_gating_top_k@aclnn")
    require(renorm in (0, 1), op, "renorm", f"must be 0 or 1, got {renorm}", "npu_moe_gating_top_k@aclnn")


def check_moe_gating_top_k_softmax(x, finished, k) -> None:
    op = "npu_moe_gating_top_k_softmax"
    require_dtype(x, (F16, BF16, F32), op, "x")
    require(x.dim() in (2, 3), op, "x", f"must be 2-D or 3-D, got shape {tuple(x.shape)}")
    require(0 < k <= min(x.shape[-1], 1024), op, "k", f"must be in (0, min(experts, 1024)], got {k}")
    if finished is not None:
        require_dtype(finished, (torch.bool,), op, "finished")


def check_swiglu(x, dim) -> None:
    op = "npu_swiglu"
    require_dtype(x, (F16, BF16, F32), op, "x")
    require(x.shape[dim] % 2 == 0, op, "x", f"dim {dim} must have an even size, got {x.shape[dim]}")


# --------------------------------------------------------------------------- grouped matmul + swiglu + quant

def check_grouped_matmul_swiglu_quant(x, weight, weight_format: int, weight_scale, x_scale, group_list,
                                      nz_required: bool, op: str) -> None:
    doc = "npu_grouped_matmul_swiglu_quant"
    require_dtype(x, (I8,), op, "x", doc)
    require_dtype(weight, (I8,), op, "weight", doc, why=" (int4 / MX are not emulated)")
    if nz_required:
        # the int8 weight must be FRACTAL_NZ (ND only for the A8W4 / MX cases)
        require(weight_format == 29, op, "weight",
                f"an int8 weight must be FRACTAL_NZ (acl format 29, torch_npu.npu_format_cast), got format "
                f"{weight_format}", doc)
    require_dtype(weight_scale, (F32, F16, BF16), op, "weight_scale", doc)
    require_dtype(x_scale, (F32,), op, "x_scale", doc)
    require_dtype(group_list, (I64,), op, "group_list", doc)
    require(group_list.dim() == 1, op, "group_list", f"must be 1-D, got shape {tuple(group_list.shape)}", doc)
    vals = [int(v) for v in group_list.tolist()]
    require(all(a <= b for a, b in zip(vals, vals[1:])) and (not vals or vals[0] >= 0), op, "group_list",
            f"must be a non-negative non-decreasing cumsum, got {vals}", doc)
    # the output is "valid up to group_list[-1]": fewer rows than x has is allowed
    require(not vals or vals[-1] <= x.shape[0], op, "group_list",
            f"its last value ({vals[-1] if vals else 0}) must not exceed x's rows {x.shape[0]}", doc)


# --------------------------------------------------------------------------- formats

ACL_FORMAT_NCHW = 0  # get_npu_format of a fresh 4-D tensor (the page's example prints 0)
KNOWN_ACL_FORMATS = (0, 1, 2, 3, 4, 29, 30)  # NCHW NHWC ND NC1HWC0 FRACTAL_Z FRACTAL_NZ NCDHW


def check_format_cast(acl_format) -> None:
    op = "npu_format_cast"
    require(isinstance(acl_format, int) and not isinstance(acl_format, bool), op, "acl_format",
            f"must be an int acl format id, got {acl_format!r}")
    require(acl_format in KNOWN_ACL_FORMATS, op, "acl_format",
            f"must be one of the aclFormat ids {KNOWN_ACL_FORMATS}, got {acl_format}")


# --------------------------------------------------------------------------- DeepSeek shared experts
# What the current line's vllm-ascend fused-MoE layer calls for a model's INT8 shared experts
# (`ops/fused_moe/fused_moe_0_23_0.py` `_forward_shared_experts`): npu_quant_matmul with an int32
# output, then its own `torch.ops._C_ascend.npu_dequant_swiglu_quant` with swiglu_mode=1. The
# routed experts call the same _C_ascend op with swiglu_mode 0 (`ops/fused_moe/moe_mlp.py`).

# the current line's vllm-ascend binding (csrc/torch_binding.cpp `npu_dequant_swiglu_quant`): "swiglu_mode
# only support 0 or 1", "clamp_limit should be positive finite" (checked as >= 0.0: its op
# definition, csrc/moe/dequant_swiglu_quant/op_host/dequant_swiglu_quant_proto.h, documents
# "Use 0.0 to disable clamp"), glu_alpha / glu_bias finite, "x last dim should be even", x more
# than 1-D; it then runs aclnnDequantSwigluQuantV2, whose page gives the tensor rules below.
DSQ_V2_MAX_DIMS = 8  # x: "shape不超过8维，不小于2维"


def check_dequant_swiglu_quant_v2(x, weight_scale, activation_scale, bias, quant_scale, quant_offset,
                                  group_index, activate_left, quant_mode, swiglu_mode, clamp_limit,
                                  glu_alpha, glu_bias) -> None:
    import math

    op = "_C_ascend.npu_dequant_swiglu_quant"
    binding = op + "@vllm-ascend"
    require(2 <= x.dim() <= DSQ_V2_MAX_DIMS, op, "x", f"must have 2-{DSQ_V2_MAX_DIMS} dims, got shape {tuple(x.shape)}")
    require(x.shape[-1] % 2 == 0, op, "x", f"the last dim must be even (2H), got {x.shape[-1]}")
    require_dtype(x, (I32, F16, BF16), op, "x")
    require(quant_mode in (0, 1), op, "quant_mode", f"must be 0 (static) or 1 (dynamic), got {quant_mode}", binding)
    require(swiglu_mode in (0, 1), op, "swiglu_mode", f"must be 0 or 1, got {swiglu_mode}", binding)
    require(math.isfinite(clamp_limit) and clamp_limit >= 0.0, op, "clamp_limit",
            f"must be finite and >= 0 (0.0 disables the clamp), got {clamp_limit}", binding)
    require(math.isfinite(glu_alpha) and math.isfinite(glu_bias), op, "glu_alpha/glu_bias",
            f"must be finite, got {glu_alpha}, {glu_bias}", binding)
    # "如果swigluMode为1，activateLeft必须为true"
    require(swiglu_mode == 0 or activate_left, op, "activate_left", "must be True with swiglu_mode=1")
    h2 = x.shape[-1]
    rows = x.numel() // h2
    if x.dtype == I32:
        # "当输入x的数据类型为INT32时，weightScaleOptional不能为空"
        require(weight_scale is not None, op, "weight_scale", "must be given for an int32 x")
    else:
        # "当输入x的数据类型不为INT32时，weightScaleOptional / activationScaleOptional /
        # biasOptional 不允许输入"
        require(weight_scale is None and activation_scale is None and bias is None, op,
                "weight_scale/activation_scale/bias", f"must be None for a {_name(x.dtype)} x")
    if weight_scale is not None:
        require_dtype(weight_scale, (F32,), op, "weight_scale")
        # [2H] without group_index, [groupNum, 2H] with it
        want = "[groupNum, 2H]" if group_index is not None else "[2H]"
        ok = weight_scale.shape[-1] == h2 and (
            weight_scale.dim() == 2 if group_index is not None else weight_scale.dim() == 1)
        # vllm-ascend passes a layer's flattened [2H] scale with a one-group group_index (its
        # shared experts): one group's [2H] is accepted as [1, 2H]
        ok = ok or (group_index is not None and weight_scale.dim() == 1 and weight_scale.shape[0] == h2
                    and group_index.shape[0] == 1)
        require(ok, op, "weight_scale", f"must be {want} with 2H = {h2}, got shape {tuple(weight_scale.shape)}")
    if activation_scale is not None:
        require_dtype(activation_scale, (F32,), op, "activation_scale")
        # "shape为[X1,...,Xn]... 维度比x的维度少一维"
        require(tuple(activation_scale.shape) == tuple(x.shape[:-1]), op, "activation_scale",
                f"must be x's shape without its last dim {tuple(x.shape[:-1])}, got {tuple(activation_scale.shape)}")
    if bias is not None:
        require_dtype(bias, (F32, F16, BF16, I32), op, "bias")
    if quant_scale is not None:
        require_dtype(quant_scale, (F32, F16), op, "quant_scale")
    if quant_offset is not None:
        require_dtype(quant_offset, (F32,), op, "quant_offset")
    if quant_mode == 0:
        # "当quantModeOptional为static时，quantScaleOptional是空指针" is an error
        require(quant_scale is not None, op, "quant_scale", "must be given with quant_mode 0 (static)")
    if group_index is not None:
        require_dtype(group_index, (I64,), op, "group_index")
        require(group_index.dim() in (1, 2) and group_index.shape[0] >= 1, op, "group_index",
                f"must be [groupNum] or [groupNum, 2] with groupNum >= 1, got shape {tuple(group_index.shape)}")
        # "groupIndexOptional所有元素之和不能大于输入x除尾轴之外的剩余轴的乘积"
        total = int(group_index.sum())
        require(total <= rows, op, "group_index", f"its sum ({total}) must not exceed x's rows ({rows})")
