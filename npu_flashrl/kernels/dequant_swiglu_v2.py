"""vllm-ascend's own `torch.ops._C_ascend.npu_dequant_swiglu_quant` (the current line's vllm-ascend), as a
pure-torch reference kernel for the CPU emulation (`emulation.py` registers it).

the current line's vllm-ascend calls it for the routed experts (`ops/fused_moe/moe_mlp.py`, swiglu_mode 0) and
for a model's INT8 shared experts (`ops/fused_moe/fused_moe_0_23_0.py` `_forward_shared_experts`,
swiglu_mode 1, clamp_limit 0.0 unless the model sets a swiglu limit, DeepSeek-V2/V3 among them).
Its binding (`csrc/torch_binding.cpp`) runs CANN's aclnnDequantSwigluQuantV2 (schema defaults:
clamp_limit 0.0, glu_alpha 1.0, glu_bias 0.0, unlike torch_npu's op of the same name: 7.0 /
1.702 / 1.0). The documented constraints are `op_rules.check_dequant_swiglu_quant_v2`.

The computation, from the aclnnDequantSwigluQuantV2 page (`op_rules.DOC`):
dequantOut = x * weight_scale[group] * activation_scale[token] (an int32 x; fp32 arithmetic);
swiglu_mode 0: swish(A) * B with A the activated half (the left one with activate_left);
swiglu_mode 1: x_glu.clamp(max=clamp_limit), x_linear.clamp(-clamp_limit, clamp_limit) (no clamp
when clamp_limit is 0.0: vllm-ascend's op definition, `dequant_swiglu_quant_proto.h`),
out = x_glu * sigmoid(glu_alpha * x_glu) * (x_linear + glu_bias); then dynamic per-row int8
(scale = rowmax|y| / 127, round half to even, saturating).

Where the documents disagree (NOT VERIFIED ON HARDWARE): the page and vllm-ascend's proto.h say
swiglu_mode 1 splits x into EVEN / ODD columns ("奇偶分块"); the current line's vllm-ascend kernel
(`csrc/moe/dequant_swiglu_quant/op_kernel/dequant_swiglu_quant.h`, `SwiGluGate` and
`CreateOffsetLocalTensor`: "直接使用前一半和后一半数据") reads the first and second HALVES, as
vLLM's merged gate_up_proj lays them out. This emulation follows the kernel vllm-ascend ships
(x_glu = the left half, x_linear = the right half); on an NPU host `npu-flashrl verify --kernels`
runs the case "_C_ascend.npu_dequant_swiglu_quant / swiglu_mode 1" against that golden, and a
"differs" row there means the device splits odd / even.

Not emulated (NotImplementedError naming the argument): bias, quant_scale / quant_offset (smooth
or static quant, quant_mode 0), a [groupNum, 2] group_index, a non-int32 x.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from npu_flashrl.kernels import op_rules
from npu_flashrl.kernels.moe_reference import check_dequant_swiglu_args
from npu_flashrl.kernels.reference import INT8_MAX

OP = "_C_ascend.npu_dequant_swiglu_quant"


def _not_emulated(what: str) -> NotImplementedError:
    return NotImplementedError(f"torch.ops.{OP}: {what} is not emulated (npu_flashrl.kernels.dequant_swiglu_v2)")


def _quant_rows(y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    absmax = y.abs().amax(dim=-1)
    scale = absmax / INT8_MAX
    safe = torch.where(absmax > 0, scale, torch.ones_like(scale))
    return torch.round(y / safe.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8), scale.float()


def swiglu_halves(d: torch.Tensor, activate_left: bool, swiglu_mode: int, clamp_limit: float,
                  glu_alpha: float, glu_bias: float) -> torch.Tensor:
    """The activation on a dequantized [rows, 2H] block (float64), halves as vllm-ascend's kernel."""
    left, right = d.chunk(2, dim=-1)
    act, lin = (left, right) if activate_left else (right, left)
    if swiglu_mode == 0:
        return act * torch.sigmoid(act) * lin
    if clamp_limit > 0.0:
        act = act.clamp(max=clamp_limit)
        lin = lin.clamp(min=-clamp_limit, max=clamp_limit)
    return act * torch.sigmoid(glu_alpha * act) * (lin + glu_bias)


def npu_dequant_swiglu_quant(x: torch.Tensor, *, weight_scale: Optional[torch.Tensor] = None,
                             activation_scale: Optional[torch.Tensor] = None,
                             bias: Optional[torch.Tensor] = None,
                             quant_scale: Optional[torch.Tensor] = None,
                             quant_offset: Optional[torch.Tensor] = None,
                             group_index: Optional[torch.Tensor] = None,
                             activate_left: bool = True, quant_mode: int = 0,
                             swiglu_mode: int = 0, clamp_limit: float = 0.0,
                             glu_alpha: float = 1.0, glu_bias: float = 0.0
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """torch.ops._C_ascend.npu_dequant_swiglu_quant (see the module doc). Returns (int8 y
    [..., H], fp32 scale [...]); rows past the sum of group_index are zero (the page: left
    uncleared)."""
    check_dequant_swiglu_args(
        OP, _not_emulated, x, weight_scale, activation_scale, bias, quant_scale, quant_offset,
        group_index, quant_mode,
        documented=lambda: op_rules.check_dequant_swiglu_quant_v2(
            x, weight_scale, activation_scale, bias, quant_scale, quant_offset, group_index,
            activate_left, quant_mode, swiglu_mode, clamp_limit, glu_alpha, glu_bias))
    if x.dtype != torch.int32:
        raise _not_emulated(f"a {x.dtype} x (int32 is)")
    if group_index is not None and group_index.dim() != 1:
        raise _not_emulated("a [groupNum, 2] group_index (count mode [groupNum] is)")
    h2 = x.shape[-1]
    lead = x.shape[:-1]
    xf = x.reshape(-1, h2).double()
    rows = xf.shape[0]
    if activation_scale is not None:
        xf = xf * activation_scale.reshape(rows, 1).double()
    ws = weight_scale.reshape(-1, h2).double()
    counts = [rows] if group_index is None else [int(c) for c in group_index.tolist()]
    y = torch.zeros(rows, h2 // 2, dtype=torch.int8, device=x.device)
    scale = torch.zeros(rows, dtype=torch.float32, device=x.device)
    start = 0
    for g, c in enumerate(counts):
        if c < 0:
            raise op_rules.refuse(OP, "group_index", f"counts must be non-negative, got {counts}")
        if c == 0:
            continue
        d = xf[start:start + c] * ws[g]
        act = swiglu_halves(d, activate_left, swiglu_mode, clamp_limit, glu_alpha, glu_bias)
        y[start:start + c], scale[start:start + c] = _quant_rows(act.float())
        start += c
    return y.reshape(*lead, h2 // 2), scale.reshape(lead)


__all__ = ["npu_dequant_swiglu_quant", "swiglu_halves", "OP"]
