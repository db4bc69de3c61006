"""NPU implementations of the INT8 kernels: the same semantics as `reference`, on torch_npu ops.

Only imported when a tensor lives on an NPU. Not verified on hardware here (no NPU in CI); run
`pytest tests/kernels/test_kernels.py --npu` on an Atlas node to compare against the reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from npu_flashrl.kernels import op_rules, reference


def quantize_weight_per_channel(weight: torch.Tensor, compute_dtype: Optional[torch.dtype] = None,
                                transposed: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    import torch_npu  # noqa: F401  (real torch_npu on an NPU node)

    if compute_dtype is not None and weight.dtype != compute_dtype:
        weight = weight.to(compute_dtype)
    if weight.dtype == torch.float32:
        weight = weight.to(torch.bfloat16)
    # The reference's refusal, in one reduction pass: a NaN/Inf row would otherwise give a
    # non-finite scale (or, on hardware, a saturated int8 row) and poison the rollout silently.
    if not reference.all_finite(weight):
        raise ValueError("quantize_weight_per_channel: weight contains NaN or Inf")
    if weight.shape[-1] > op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3:
        # npu_dynamic_quant's page limits a row to 11264 values on Atlas A2 up to Ascend
        # Extension for PyTorch 6.0.RC3 (Qwen2.5-7B's down_proj rows have 18944); the release
        # cannot be told reliably from torch_npu.__version__, so longer rows always take the
        # other documented way: the same scales in plain torch, then npu_quantize.
        return _per_channel_by_quantize(weight, transposed)
    # Per-row symmetric int8 with scale = rowmax/127 is exactly npu_dynamic_quant on the rows.
    q, scale = torch_npu.npu_dynamic_quant(weight)
    # An all-zero row: the reference defines scale 1.0 (q is 0 either way).
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if transposed:  # same values, [in, out] memory (the processed W8A8 layout)
        q = q.t().contiguous().t()
    return q, scale


def _per_channel_by_quantize(weight: torch.Tensor, transposed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """scale = rowmax|w| / 127 in fp32 (1.0 for an all-zero row), q = npu_quantize(w / scale):
    div_mode True takes a float32 scales tensor along the LAST axis (the only elementwise axis
    older releases document), so it quantizes w^T [in, out] with one scale per column; the
    result is already the processed [in, out] layout."""
    import torch_npu  # noqa: F401

    absmax = torch.maximum(weight.amax(dim=1), weight.amin(dim=1).neg()).float()
    scale = torch.where(absmax > 0, absmax / reference.INT8_MAX, torch.ones_like(absmax))
    q_t = torch_npu.npu_quantize(weight.t(), scale, None, torch.qint8, -1, True).contiguous()  # [in, out]
    q = q_t.t()
    return (q if transposed else q.contiguous()), scale


def storage_format(t: torch.Tensor) -> int:
    import torch_npu  # noqa: F401

    return int(torch_npu.get_npu_format(t))


def to_host_nd(t: torch.Tensor) -> torch.Tensor:
    """NZ (FRACTAL_NZ, vllm-ascend's processed W8A8 weights) -> ND on the device, then to the host:
    npu_format_cast returns a new ND tensor, the live NZ storage is not touched."""
    import torch_npu  # noqa: F401

    from npu_flashrl.kernels.reference import ACL_FORMAT_ND

    t = t.detach()
    if int(torch_npu.get_npu_format(t)) != ACL_FORMAT_ND:
        t = torch_npu.npu_format_cast(t, ACL_FORMAT_ND)
    return t.cpu()
