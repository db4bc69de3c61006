"""What every online quantizer is: an incoming full-precision HF tensor -> what the INT8 rollout
model holds. Pure math over `npu_flashrl.kernels`; nothing here imports upstream code."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from npu_flashrl.errors import NpuFlashrlError


class WeightSyncError(NpuFlashrlError, ValueError):
    """A weight sync was refused; the message names the parameter. Live weights are unchanged
    for every layer the failing tensor belongs to."""


class OnlineQuantizer:
    """How an incoming full-precision HF tensor becomes what the INT8 rollout model holds."""

    name = ""
    writes_scales = True
    dense_only = False
    # True: `quantize(..., finite=list)` appends its NaN / Inf refusal as a device-side bool
    # instead of raising (the caller reads a call's flags back together, before any write)
    defers_finite_check = False  # True: cannot quantize fused-MoE experts (refused at engine build)

    # the quant type a bf16 checkpoint's in-memory description gives the projections this
    # quantizer serves (`adapters/vllm_ascend/description.py`)
    description_type = "W8A8_DYNAMIC"
    # a `group_size` config key: None, the quantizer has no groups (the key is refused)
    default_group_size: Optional[int] = None

    def __init__(self, compute_dtype: torch.dtype = torch.bfloat16):
        self.compute_dtype = compute_dtype

    @classmethod
    def from_entry(cls, compute_dtype: torch.dtype, profile: Optional[dict] = None,
                   **options) -> "OnlineQuantizer":
        """Build from a config entry's pieces (the profile is ignored unless the method uses one;
        `options`: the entry's keys the quantizer takes, e.g. `group_size`)."""
        return cls(compute_dtype, **options)

    @classmethod
    def description_keys(cls, group_size: Optional[int] = None) -> dict:
        """The top-level keys of the in-memory quant description of a bf16 checkpoint (beside
        the per-weight types), for the entry's `group_size` (None: the default)."""
        return {}

    def quantize(self, name: str, weight: torch.Tensor, transposed: bool = False
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Full weight [out, in] -> (int8 [out, in], fp32 scale [out] or None to keep scales).
        `transposed`: the int8 result lives in [in, out] memory (see the kernels)."""
        raise NotImplementedError

    def check(self, name: str, weight: torch.Tensor) -> None:
        """Refuse a projection this quantizer cannot handle, before any write (default: all ok)."""

    def check_model(self, shapes, source: str) -> None:
        """Refuse, when the engine builds, a quantizer that cannot serve the model whose tensors
        have `shapes` (HF name -> full shape; `source` names the model). Default: all ok."""

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A non-quantized tensor as the INT8 model wants it (identity unless a profile says)."""
        return tensor
