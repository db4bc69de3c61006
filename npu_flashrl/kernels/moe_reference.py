"""Pure-torch reference kernels for the fused-MoE ops vllm-ascend's W8A8_DYNAMIC MoE path calls.

These define the semantics the CPU emulation gives `torch_npu.*` and vllm-ascend's own
`torch.ops._C_ascend.*` MoE ops (`emulation.py` wires them up). No upstream import: each kernel
follows the op's documentation, named in its docstring:

- [torch_npu] Ascend op-plugin `docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md`
  (github.com/Ascend/op-plugin, the torch_npu API reference; npu_grouped_matmul_swiglu_quant is
  documented in its `codegen/templates/_op_plugin_docs.py` docstrings);
- [aclnn] CANN `aclnnMoeTokenUnpermute` (hiascend.com CANNCommunityEdition 8.2.RC1 API reference);
- [vllm-ascend] the newest line's vllm-ascend (`npu_flashrl/lines/`) `csrc/torch_binding.cpp` (schemas),
  `csrc/gmm/grouped_matmul_swiglu_quant/README.md`, and the NumPy goldens of its op tests
  `tests/e2e/nightly/single_node/ops/singlecard_ops/test_{npu_moe_gating_top_k,
  moe_init_routing_custom}.py`.

Only the modes the W8A8_DYNAMIC MoE path uses are emulated; any other mode raises
NotImplementedError naming the op and the argument. Operands on different devices are refused
(`require_same_device`), as in `reference.py`. Arithmetic is fp32 (integer matmuls are exact in
float64), rounding is round-half-to-even (`torch.round`), int8 results saturate.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from npu_flashrl.kernels import op_rules
from npu_flashrl.kernels.reference import INT8_MAX, _require, get_npu_format, require_same_device

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _not_emulated(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {what} is not emulated (npu_flashrl.kernels.moe_reference)")


def _swish(z: torch.Tensor) -> torch.Tensor:
    return z * torch.sigmoid(z)


def _dynamic_quant_rows(y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of an fp32 matrix: scale = rowmax|y| / 127, q = round(y / scale)
    (the dynamic quantization every MoE op below documents); an all-zero row gets q = 0."""
    absmax = y.abs().amax(dim=-1)
    scale = absmax / INT8_MAX
    safe = torch.where(absmax > 0, scale, torch.ones_like(scale))
    q = torch.round(y / safe.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
    return q, scale


# --------------------------------------------------------------------------- routing

def moe_gating_top_k(x: torch.Tensor, k: int, *, bias: Optional[torch.Tensor] = None,
                     k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                     renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0, eps: float = 1e-20,
                     op: str = "npu_moe_gating_top_k"
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[torch_npu] npu_moe_gating_top_k / [vllm-ascend] _C_ascend::moe_gating_top_k.

    norm = softmax(x) (norm_type 0) or sigmoid(x) (1), in fp32; selection scores = norm + bias;
    with group_count > 1 the experts are split into groups scored by their max (mode 0) or the
    sum of their top two (mode 1), and all but the best k_group groups are masked out; the top k
    experts by score (stable: ties keep the lower index) give expert_idx (int32), and
    y = norm[expert_idx] (the unbiased values), divided by (sum + eps) when norm_type == 1 or
    renorm == 1, times routed_scaling_factor, cast to x's dtype. torch_npu documents renorm 0
    only; vllm-ascend's op also takes renorm 1 (its golden renormalises, as for sigmoid).
    Returns (y, expert_idx, norm_out): norm_out is the fp32 norm when out_flag, else empty.
    Documented constraints: `op_rules.check_moe_gating_top_k` (for both ops: vllm-ascend's op
    wraps the same aclnnMoeGatingTopK kernel)."""
    require_same_device(op, x=x, bias=bias)
    op_rules.check_moe_gating_top_k(x, k, bias, k_group, group_count, group_select_mode, renorm,
                                    norm_type, op=op)
    n_exp = x.shape[1]
    xf = x.float()
    norm = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    score = norm
    if bias is not None:
        _require(tuple(bias.shape) == (n_exp,), op, f"bias must have shape ({n_exp},), got {tuple(bias.shape)}")
        score = norm + bias.float()
    if group_count > 1:
        grouped = score.reshape(x.shape[0], group_count, -1)
        if group_select_mode == 0:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :k_group]
        masked = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        score = grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).reshape(x.shape[0], -1)
    idx = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1 or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = norm if out_flag else torch.empty(0, dtype=torch.float32, device=x.device)
    return y.to(x.dtype), idx.to(torch.int32), out


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: Optional[torch.Tensor] = None,
                                 k: int = 1) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[torch_npu] npu_moe_gating_top_k_softmax: softmax over the last axis (fp32), top k
    (values in x's dtype, indices int32), and row_idx = arange(N*k).reshape(k, N).T (int32).
    `finished` rows (True = do not compute) are not emulated."""
    op = "npu_moe_gating_top_k_softmax"
    require_same_device(op, x=x, finished=finished)
    op_rules.check_moe_gating_top_k_softmax(x, finished, k)
    if finished is not None or x.dim() != 2:
        raise _not_emulated(op, "finished / a 3-D x")
    soft = torch.softmax(x.float(), dim=-1)
    y, idx = torch.sort(soft, dim=-1, descending=True, stable=True)
    n = x.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32, device=x.device).reshape(k, n).t().contiguous()
    return y[:, :k].to(x.dtype), idx[:, :k].to(torch.int32), row_idx


def npu_moe_init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, *,
                            scale: Optional[torch.Tensor] = None, offset: Optional[torch.Tensor] = None,
                            active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
                            drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                            expert_tokens_num_flag: bool = False, quant_mode: int = 0,
                            active_expert_range: Sequence[int] = (), row_idx_type: int = 0
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[torch_npu] npu_moe_init_routing_v2 with the page's signature and defaults (quant_mode 0,
    static, is the default and is not supported) and its documented constraints
    (`op_rules.check_moe_init_routing_v2`), computed by `moe_init_routing`."""
    require_same_device("npu_moe_init_routing_v2", x=x, expert_idx=expert_idx, scale=scale, offset=offset)
    op_rules.check_moe_init_routing_v2(x, expert_idx, scale, offset, active_num, expert_capacity,
                                       expert_num, drop_pad_mode, expert_tokens_num_type,
                                       expert_tokens_num_flag, quant_mode, active_expert_range,
                                       row_idx_type)
    return moe_init_routing(x, expert_idx, scale=scale, offset=offset, active_num=active_num,
                            expert_capacity=expert_capacity, expert_num=expert_num,
                            drop_pad_mode=drop_pad_mode, expert_tokens_num_type=expert_tokens_num_type,
                            expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
                            active_expert_range=active_expert_range, row_idx_type=row_idx_type)


def moe_init_routing(x: torch.Tensor, expert_idx: torch.Tensor, *,
                     scale: Optional[torch.Tensor] = None, offset: Optional[torch.Tensor] = None,
                     active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
                     drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                     expert_tokens_num_flag: bool = False, quant_mode: int = -1,
                     active_expert_range: Sequence[int] = (), row_idx_type: int = 0
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing kernel of [torch_npu] npu_moe_init_routing_v2 and [vllm-ascend]
    _C_ascend::npu_moe_init_routing_custom (same schema and golden), dropless mode.

    The N*K (token, slot) entries of expert_idx [N, K] are sorted by expert, stably (entries of
    equal expert keep their flat order n*K + j); entries outside active_expert_range
    [start, end) (default [0, expert_num)) go last and are not routed. Returns
    - expanded_x [rows, H]: row i is x[sorted_entry[i] // K] (quant_mode -1), or its per-row
      dynamic int8 (quant_mode 1: scale = rowmax|x| / 127, q = round(x / scale)); rows = N*K, or
      min(N*K, active_num) when active_num > 0; rows past the routed entries are zero;
    - expanded_row_idx [N*K] int32: row_idx_type 0 (gather) expanded_row_idx[sorted_entry[i]] = i,
      -1 for unrouted entries; row_idx_type 1 (scatter) sorted_entry[i] (-1 past the routed ones);
    - expert_tokens int64: per expert in [start, end) the routed-entry count
      (expert_tokens_num_type 1) or its cumsum (0); zeros unless expert_tokens_num_flag;
    - expanded_scale [rows] fp32: the dynamic-quant scales (quant_mode 1), scale[token] carried
      along (quant_mode -1 with a scale), else zeros (documented as meaningless).
    Not emulated: drop/pad mode, static quant (quant_mode 0), smooth scales with quant_mode 1,
    the key-value histogram (type 2) and the MX/FP8/HIF8/INT4 modes."""
    op = "moe_init_routing"
    require_same_device(op, x=x, expert_idx=expert_idx, scale=scale, offset=offset)
    _require(x.dim() == 2, op, f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    _require(expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0], op,
             f"expert_idx must be 2-D [{x.shape[0]}, k], got shape {tuple(expert_idx.shape)}")
    _require(expert_idx.dtype in (torch.int32, torch.int64), op,
             f"expert_idx must be int32, got {expert_idx.dtype}")
    if drop_pad_mode != 0:
        raise _not_emulated(op, f"drop_pad_mode={drop_pad_mode} (only dropless, 0, is)")
    if quant_mode not in (-1, 1):
        raise _not_emulated(op, f"quant_mode={quant_mode} (-1 none and 1 dynamic int8 are)")
    if quant_mode == 1 and scale is not None:
        raise _not_emulated(op, "smooth scale with quant_mode=1")
    if expert_tokens_num_type not in (0, 1):
        raise _not_emulated(op, f"expert_tokens_num_type={expert_tokens_num_type} (0 cumsum, 1 count are)")
    _require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")
    rng = list(active_expert_range) if active_expert_range else [0, expert_num]
    _require(len(rng) == 2 and 0 <= rng[0] <= rng[1] and (expert_num < 0 or rng[1] <= expert_num), op,
             f"active_expert_range must be [start, end) with 0 <= start <= end <= expert_num={expert_num}, "
             f"got {list(active_expert_range)}")
    start, end = int(rng[0]), int(rng[1])
    n, h = x.shape
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).to(torch.int64)
    routed = (flat >= start) & (flat < end)
    n_routed = int(routed.sum())
    key = torch.where(routed, flat, torch.full_like(flat, torch.iinfo(torch.int64).max))
    sorted_key, order = torch.sort(key, stable=True)
    rows = n * k if active_num <= 0 else min(n * k, active_num)
    n_out = min(rows, n_routed)
    src = order[:n_out] // k
    if quant_mode == 1:
        q, qscale = _dynamic_quant_rows(x[src].float())
        expanded_x = torch.zeros((rows, h), dtype=torch.int8, device=x.device)
        expanded_x[:n_out] = q
        expanded_scale = torch.zeros(rows, dtype=torch.float32, device=x.device)
        expanded_scale[:n_out] = qscale
    else:
        expanded_x = torch.zeros((rows, h), dtype=x.dtype, device=x.device)
        expanded_x[:n_out] = x[src]
        expanded_scale = torch.zeros(rows, dtype=torch.float32, device=x.device)
        if scale is not None:
            _require(scale.shape[0] == n, op, f"scale must have {n} rows (one per token), got {tuple(scale.shape)}")
            expanded_scale[:n_out] = scale.reshape(n, -1)[src, 0].float()
    expanded_row_idx = torch.full((n * k,), -1, dtype=torch.int32, device=x.device)
    if row_idx_type == 0:
        expanded_row_idx[order[:n_routed]] = torch.arange(n_routed, dtype=torch.int32, device=x.device)
    else:
        expanded_row_idx[:n_routed] = order[:n_routed].to(torch.int32)
    counts = torch.bincount(sorted_key[:n_routed] - start, minlength=end - start)[: end - start]
    if expert_tokens_num_type == 0:
        counts = counts.cumsum(0)
    if not expert_tokens_num_flag:
        counts = torch.zeros_like(counts)
    return expanded_x, expanded_row_idx, counts.to(torch.int64), expanded_scale


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: Optional[torch.Tensor] = None, padded_mode: bool = False,
                            restore_shape=None) -> torch.Tensor:
    """[aclnn] aclnnMoeTokenUnpermute (torch_npu.npu_moe_token_unpermute):
    out[i] = sum_j permuted_tokens[sorted_indices[i*K + j]] * probs[i, j], j < K = probs.shape[1]
    (K = 1 and no product without probs), accumulated in fp32, in permuted_tokens' dtype.
    sorted_indices is the gather index npu_moe_init_routing(_v2) returns (row_idx_type 0).
    Padded mode is not emulated."""
    op = "npu_moe_token_unpermute"
    require_same_device(op, permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, probs=probs)
    op_rules.check_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)
    if padded_mode:
        raise _not_emulated(op, "padded_mode=True")
    _require(permuted_tokens.dim() == 2, op,
             f"permuted_tokens must be 2-D [tokens*topk, hidden], got shape {tuple(permuted_tokens.shape)}")
    _require(sorted_indices.dim() == 1, op, f"sorted_indices must be 1-D, got shape {tuple(sorted_indices.shape)}")
    topk = 1 if probs is None else probs.shape[-1]
    total = sorted_indices.numel()
    _require(total % topk == 0, op, f"sorted_indices has {total} entries, not a multiple of topk={topk}")
    n = total // topk
    if probs is not None:
        _require(probs.dim() == 2 and probs.shape[0] == n, op,
                 f"probs must be [{n}, {topk}], got shape {tuple(probs.shape)}")
    idx = sorted_indices.to(torch.int64)
    _require(bool(((idx >= 0) & (idx < permuted_tokens.shape[0])).all()), op,
             f"sorted_indices must lie in [0, {permuted_tokens.shape[0]}) (every entry routed)")
    t = permuted_tokens.float()[idx].reshape(n, topk, -1)
    if probs is not None:
        t = t * probs.float().unsqueeze(-1)
    return t.sum(dim=1).to(permuted_tokens.dtype)


# --------------------------------------------------------------------------- expert matmuls

def _group_bounds(group_list: torch.Tensor, group_list_type: int, groups: int, rows: int,
                  op: str) -> List[Tuple[int, int]]:
    """[start, end) rows of each group from a cumsum (type 0) or count (type 1) group_list."""
    _require(group_list.dim() == 1 and group_list.numel() == groups, op,
             f"group_list must be 1-D with one entry per group ({groups}), got shape {tuple(group_list.shape)}")
    vals = [int(v) for v in group_list.tolist()]
    _require(all(v >= 0 for v in vals), op, f"group_list must be non-negative, got {vals}")
    if group_list_type == 1:
        ends, acc = [], 0
        for v in vals:
            acc += v
            ends.append(acc)
    elif group_list_type == 0:
        _require(all(a <= b for a, b in zip(vals, vals[1:])), op,
                 f"a cumsum group_list (group_list_type 0) must be non-decreasing, got {vals}")
        ends = vals
    else:
        raise _not_emulated(op, f"group_list_type={group_list_type} (0 cumsum, 1 count are)")
    _require(not ends or ends[-1] <= rows, op, f"group_list covers {ends[-1] if ends else 0} rows, x has {rows}")
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def _expert_weights(weight: Sequence[torch.Tensor], op: str) -> List[torch.Tensor]:
    """The per-group [K, N] weights: one 3-D [E, K, N] tensor, or a list of E 2-D tensors."""
    _require(isinstance(weight, (list, tuple)) and len(weight) >= 1, op,
             "weight must be a list of tensors")
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    _require(all(w.dim() == 2 for w in weight), op,
             "weight must be one 3-D [E, K, N] tensor or a list of 2-D [K, N] tensors")
    return list(weight)


def _per_group(t: Optional[Sequence[torch.Tensor]], groups: int, n: int, op: str, name: str):
    if t is None:
        return None
    _require(isinstance(t, (list, tuple)) and len(t) >= 1, op, f"{name} must be a list of tensors")
    if len(t) == 1 and t[0].dim() == 2:
        s = t[0]
    else:
        s = torch.stack([v.reshape(-1) for v in t])
    _require(tuple(s.shape) == (groups, n), op,
             f"{name} must hold [{groups}, {n}] values (one row per group), got {tuple(s.shape)}")
    return s


def npu_grouped_matmul(x: List[torch.Tensor], weight: List[torch.Tensor], *,
                       bias: Optional[List[torch.Tensor]] = None,
                       scale: Optional[List[torch.Tensor]] = None,
                       offset: Optional[List[torch.Tensor]] = None,
                       antiquant_scale: Optional[List[torch.Tensor]] = None,
                       antiquant_offset: Optional[List[torch.Tensor]] = None,
                       per_token_scale: Optional[List[torch.Tensor]] = None,
                       group_list: Optional[Union[torch.Tensor, List[int]]] = None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item: int = 0,
                       group_type: Optional[int] = None, group_list_type: int = 0,
                       act_type: int = 0, output_dtype: Optional[torch.dtype] = None,
                       tuning_config=None) -> List[torch.Tensor]:
    """[torch_npu] npu_grouped_matmul, the m-axis grouped form MoE uses: one x [M, K] split into
    row groups by group_list (a Tensor; group_list_type 0 cumsum, 1 counts), group i times
    weight_i [K, N] (one 3-D [E, K, N] tensor or E 2-D tensors), one output [M, N] (split_item
    2/3). group_list must cover every row of x (`op_rules.check_grouped_matmul`: its last value /
    sum equals M), as must the data type combination of the page's table 2.
    - float x and weight (formula 1): y = x @ w (+ bias), fp32, in output_dtype (default x's);
    - int8 x and weight, no scale, output_dtype int32: the exact int32 accumulator;
    - int8 x and weight with scale [E, N] and per_token_scale [M] (formula 3, per-token):
      y = (x @ w) * scale_i * per_token_scale (+ float bias) in output_dtype (bf16/fp16);
      with scale but no per_token_scale (formula 2, per-channel) likewise without it.
    Not emulated: antiquant (weight-only), offset, activations (act_type != 0), k-axis groups,
    multi-tensor x."""
    op = "npu_grouped_matmul"
    _require(isinstance(x, (list, tuple)) and len(x) == 1, op,
             "x must be a list holding one [M, K] tensor (multi-tensor x is not emulated)")
    xs = x[0]
    operands = {"x": xs, "group_list": group_list if isinstance(group_list, torch.Tensor) else None}
    for name, lst in (("weight", weight), ("bias", bias), ("scale", scale),
                      ("per_token_scale", per_token_scale)):
        for i, t in enumerate(lst or []):
            operands[f"{name}[{i}]"] = t
    require_same_device(op, **operands)
    for name, v in (("offset", offset), ("antiquant_scale", antiquant_scale),
                    ("antiquant_offset", antiquant_offset), ("activation_input", activation_input),
                    ("activation_quant_scale", activation_quant_scale),
                    ("activation_quant_offset", activation_quant_offset)):
        if v:
            raise _not_emulated(op, name)
    if act_type != 0:
        raise _not_emulated(op, f"act_type={act_type}")
    if split_item not in (2, 3):
        raise _not_emulated(op, f"split_item={split_item} (2/3, one output tensor, are)")
    if group_type != 0:
        raise _not_emulated(op, f"group_type={group_type} (0, m-axis groups, is)")
    _require(xs.dim() == 2, op, f"x[0] must be 2-D [M, K], got shape {tuple(xs.shape)}")
    ws = _expert_weights(weight, op)
    groups = len(ws)
    m, kdim = xs.shape
    n = ws[0].shape[1]
    _require(all(tuple(w.shape) == (kdim, n) for w in ws), op,
             f"every weight must be [K={kdim}, N={n}], got {[tuple(w.shape) for w in ws]}")
    op_rules.check_grouped_matmul(xs, ws, len(weight) == 1 and weight[0].dim() == 3, bias, scale,
                                  per_token_scale, group_list, group_list_type, output_dtype)
    if scale is not None and scale[0].dtype == torch.int64:
        raise _not_emulated(op, "an int64 scale (the int8 output)")
    bounds = _group_bounds(group_list, group_list_type, groups, m, op)
    quant = xs.dtype == torch.int8
    scales = _per_group(scale, groups, n, op, "scale")
    biases = _per_group(bias, groups, n, op, "bias")
    pts = None
    if per_token_scale is not None:
        _require(len(per_token_scale) == 1 and per_token_scale[0].dim() == 1 and
                 per_token_scale[0].numel() == m, op,
                 f"per_token_scale must be one 1-D tensor of M={m} values")
        _require(scales is not None, op, "per_token_scale needs scale")
        pts = per_token_scale[0]
    out_dtype = output_dtype or xs.dtype
    out = torch.zeros((m, n), dtype=out_dtype, device=xs.device)
    for g, (s, e) in enumerate(bounds):
        if e <= s:
            continue
        if quant:
            acc = torch.matmul(xs[s:e].double(), ws[g].double())
            if biases is not None and biases.dtype == torch.int32:
                acc = acc + biases[g].double()
            if scales is None:
                out[s:e] = acc.to(torch.int32)
                continue
            y = acc * scales[g].double()
            if pts is not None:
                y = y * pts[s:e].double().unsqueeze(-1)
            if biases is not None and biases.dtype != torch.int32:
                y = y + biases[g].double()
            out[s:e] = y.to(out_dtype)
        else:
            y = torch.matmul(xs[s:e].float(), ws[g].float())
            if biases is not None:
                y = y + biases[g].float()
            out[s:e] = y.to(out_dtype)
    return [out]


def grouped_matmul_swiglu_quant_weight_nz(x, weight, weight_scale, x_scale, group_list, *, bias=None,
                                          offset=None, swiglu_limit: float = 0.0):
    """[vllm-ascend] _C_ascend::grouped_matmul_swiglu_quant_weight_nz (aclnnGroupedMatmulSwiglu
    QuantWeightNZ): `grouped_matmul_swiglu_quant` on a FRACTAL_NZ int8 weight."""
    return grouped_matmul_swiglu_quant(x, weight, weight_scale, x_scale, group_list, bias=bias,
                                       offset=offset, swiglu_limit=swiglu_limit, nz_weight=True,
                                       op="grouped_matmul_swiglu_quant_weight_nz")


def npu_grouped_matmul_swiglu_quant(x, weight, group_list, weight_scale, x_scale, *, bias=None,
                                    offset=None):
    """[torch_npu] npu_grouped_matmul_swiglu_quant (its kernel is the WeightNZ one: the int8
    weight must be FRACTAL_NZ)."""
    return grouped_matmul_swiglu_quant(x, weight, weight_scale, x_scale, group_list, bias=bias,
                                       offset=offset, nz_weight=True, op="npu_grouped_matmul_swiglu_quant")


def grouped_matmul_swiglu_quant(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                x_scale: torch.Tensor, group_list: torch.Tensor, *,
                                bias: Optional[torch.Tensor] = None,
                                offset: Optional[torch.Tensor] = None,
                                swiglu_limit: float = 0.0, nz_weight: bool = False,
                                op: str = "grouped_matmul_swiglu_quant"
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[vllm-ascend] _C_ascend::grouped_matmul_swiglu_quant(_weight_nz) (README
    csrc/gmm/grouped_matmul_swiglu_quant), also [torch_npu] npu_grouped_matmul_swiglu_quant
    (x, weight, group_list, weight_scale, x_scale; "valid up to group_list[-1]"):
    for group i (rows [groupList[i-1], groupList[i]) of the cumsum group_list),
    C = (X_i @ W_i) * x_scale_i * w_scale_i (int8 x [M, K], int8 W [E, K, N], fp32 x_scale [M],
    w_scale [E, N]); C_act, gate = split(C) in halves; S = swish(C_act) * gate;
    Q_scale = rowmax|S| / 127, Q = round(S / Q_scale) (symmetric). Returns (Q int8 [M, N/2],
    Q_scale fp32 [M], Q_offset fp32 [M] = 0); rows past groupList[-1] are zero (the NPU leaves
    them unwritten). The NZ variant differs in the weight's storage format only. bias/offset and
    a swiglu clamp limit are not emulated (the README: "not supported in this version").
    Rounding: the aclnn page's formula rounds to nearest; the emulation rounds half to even.
    Documented constraints: `op_rules.check_grouped_matmul_swiglu_quant`."""
    require_same_device(op, x=x, weight=weight, weight_scale=weight_scale, x_scale=x_scale,
                        group_list=group_list, bias=bias, offset=offset)
    op_rules.check_grouped_matmul_swiglu_quant(x, weight, get_npu_format(weight), weight_scale, x_scale,
                                               group_list, nz_weight, op)
    if bias is not None or offset is not None:
        raise _not_emulated(op, "bias / offset")
    if swiglu_limit:
        raise _not_emulated(op, f"swiglu_limit={swiglu_limit}")
    _require(x.dtype == torch.int8 and x.dim() == 2, op, f"x must be int8 [M, K], got {x.dtype} {tuple(x.shape)}")
    _require(weight.dtype == torch.int8 and weight.dim() == 3 and weight.shape[1] == x.shape[1], op,
             f"weight must be int8 [E, K={x.shape[1]}, N], got {weight.dtype} {tuple(weight.shape)}")
    e, _, n = weight.shape
    _require(n % 2 == 0, op, f"weight N={n} must be even (gate and up halves)")
    _require(tuple(weight_scale.shape) == (e, n), op,
             f"weight_scale must be [E={e}, N={n}], got {tuple(weight_scale.shape)}")
    m = x.shape[0]
    _require(x_scale.dim() == 1 and x_scale.numel() == m, op, f"x_scale must be [M={m}], got {tuple(x_scale.shape)}")
    bounds = _group_bounds(group_list, 0, e, m, op)
    q = torch.zeros((m, n // 2), dtype=torch.int8, device=x.device)
    qs = torch.zeros(m, dtype=torch.float32, device=x.device)
    for g, (s, t) in enumerate(bounds):
        if t <= s:
            continue
        c = (torch.matmul(x[s:t].double(), weight[g].double()) * x_scale[s:t].double().unsqueeze(-1)
             * weight_scale[g].double()).float()
        act, gate = c.chunk(2, dim=-1)
        q[s:t], qs[s:t] = _dynamic_quant_rows(_swish(act) * gate)
    return q, qs, torch.zeros(m, dtype=torch.float32, device=x.device)


def check_dequant_swiglu_args(op: str, not_emulated: Callable[[str], Exception], x: torch.Tensor,
                              weight_scale: Optional[torch.Tensor],
                              activation_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                              quant_scale: Optional[torch.Tensor], quant_offset: Optional[torch.Tensor],
                              group_index: Optional[torch.Tensor], quant_mode: int,
                              documented: Callable[[], None]) -> None:
    """The argument checks the two dequant-swiglu-quant ops share (torch_npu's, below, and
    vllm-ascend's `_C_ascend` V2, `dequant_swiglu_v2.py`: the same arguments, their own defaults,
    documented constraints and math), in order: every tensor on x's device; the op's documented
    constraints (`documented`: its op_rules check); then what neither emulation covers, raised
    as `not_emulated(what)`: bias, smooth / static quant_scale / quant_offset, a quant_mode
    other than 1 (dynamic)."""
    require_same_device(op, x=x, weight_scale=weight_scale, activation_scale=activation_scale,
                        bias=bias, quant_scale=quant_scale, quant_offset=quant_offset,
                        group_index=group_index)
    documented()
    if bias is not None or quant_scale is not None or quant_offset is not None:
        raise not_emulated("bias / quant_scale / quant_offset")
    if quant_mode != 1:
        raise not_emulated(f"quant_mode={quant_mode} (1, dynamic, is)")


def npu_dequant_swiglu_quant(x: torch.Tensor, *, weight_scale: Optional[torch.Tensor] = None,
                             activation_scale: Optional[torch.Tensor] = None,
                             bias: Optional[torch.Tensor] = None,
                             quant_scale: Optional[torch.Tensor] = None,
                             quant_offset: Optional[torch.Tensor] = None,
                             group_index: Optional[torch.Tensor] = None,
                             activate_left: bool = False, quant_mode: int = 0,
                             swiglu_mode: int = 0, clamp_limit: float = 7.0,
                             glu_alpha: float = 1.702, glu_bias: float = 1.0
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """[torch_npu] npu_dequant_swiglu_quant (also vllm-ascend's _C_ascend op of that name), the
    standard-swiglu dynamic-quant form: x int32 [T, 2H] -> x * weight_scale[group] *
    activation_scale[token] (fp32); swiglu (activate_left: swish(left half) * right half, else
    swish(right) * left); then per-row dynamic int8. group_index holds per-group token counts
    (count mode); without it weight_scale is one row for all tokens. Returns (int8 [T, H],
    fp32 scale [T]); tokens past the groups are zero. Not emulated: bias, smooth quant_scale /
    quant_offset, static quant (quant_mode 0), the variant swiglu modes 1/2."""
    op = "npu_dequant_swiglu_quant"
    check_dequant_swiglu_args(
        op, lambda what: _not_emulated(op, what), x, weight_scale, activation_scale, bias,
        quant_scale, quant_offset, group_index, quant_mode,
        documented=lambda: op_rules.check_dequant_swiglu_quant(
            x, weight_scale, activation_scale, bias, quant_scale, quant_offset, group_index,
            quant_mode))
    if swiglu_mode != 0:
        raise _not_emulated(op, f"swiglu_mode={swiglu_mode} (0, standard swiglu, is)")
    _require(x.dim() == 2 and x.shape[1] % 2 == 0, op, f"x must be [T, 2H], got shape {tuple(x.shape)}")
    t, h2 = x.shape
    xf = x.double() if x.dtype == torch.int32 else x.float().double()
    if x.dtype == torch.int32:
        _require(activation_scale is not None, op, "an int32 x needs activation_scale")
    if weight_scale is not None:
        ws = weight_scale.reshape(-1, h2)
        if group_index is None:
            _require(ws.shape[0] == 1, op, f"weight_scale must be [1, {h2}] without group_index, got {tuple(weight_scale.shape)}")
            bounds = [(0, t)]
        else:
            bounds = _group_bounds(group_index.reshape(-1), 1, ws.shape[0], t, op)
    else:
        ws, bounds = None, [(0, t)]
    if activation_scale is not None:
        _require(activation_scale.numel() == t, op, f"activation_scale must hold T={t} values, got {tuple(activation_scale.shape)}")
        xf = xf * activation_scale.reshape(t, 1).double()
    out = torch.zeros((t, h2 // 2), dtype=torch.int8, device=x.device)
    scale = torch.zeros(t, dtype=torch.float32, device=x.device)
    for g, (s, e) in enumerate(bounds):
        if e <= s:
            continue
        rows = xf[s:e] * (ws[g].double() if ws is not None else 1.0)
        left, right = rows.float().chunk(2, dim=-1)
        y = _swish(left) * right if activate_left else _swish(right) * left
        out[s:e], scale[s:e] = _dynamic_quant_rows(y)
    return out, scale


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """[torch_npu] (beta) npu_swiglu: A, B = halves of x along dim; swish(A) * B, fp32, in x's
    dtype."""
    op_rules.check_swiglu(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    return (_swish(a) * b).to(x.dtype)


__all__ = ["moe_gating_top_k", "npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2",
           "moe_init_routing", "npu_moe_token_unpermute", "npu_grouped_matmul",
           "grouped_matmul_swiglu_quant", "grouped_matmul_swiglu_quant_weight_nz",
           "npu_grouped_matmul_swiglu_quant",
           "npu_dequant_swiglu_quant", "npu_swiglu"]
