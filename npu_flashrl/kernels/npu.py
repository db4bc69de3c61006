"""NPU implementations of the INT8 kernels: the same semantics as `reference`, on torch_npu ops.

Only imported when a tensor lives on an NPU. Not verified on hardware here (no NPU in CI); run
`pytest tests/test_kernels.py --npu` on an Atlas node to compare against the reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from npu_flashrl.kernels import reference


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
    # Per-row symmetric int8 with scale = rowmax/127 is exactly npu_dynamic_quant on the rows.
    q, scale = torch_npu.npu_dynamic_quant(weight)
    # An all-zero row: the reference defines scale 1.0 (q is 0 either way).
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if transposed:  # same values, [in, out] memory (the processed W8A8 layout)
        q = q.t().contiguous().t()
    return q, scale


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
