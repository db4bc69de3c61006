"""FlashRL's `int8`: fixed scales from a profile (`npu-flashrl profile`)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from npu_flashrl import kernels
from npu_flashrl.quant.base import OnlineQuantizer, WeightSyncError
from npu_flashrl.quant.registry import register_quantizer


@register_quantizer("int8")
class ProfileQuantizer(OnlineQuantizer):
    """FlashRL's `int8` profile: fixed scales (the checkpoint's weight_scale stays), layernorm
    smoothing, the up/down beta; same math as flash_rl 1.0.3 `linear_quantize`."""

    writes_scales = False
    dense_only = True  # FlashRL's profile has entries for the seven dense projections only

    def __init__(self, profile: Dict[str, dict], compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__(compute_dtype)
        self.profile = profile
        # Profiles load to the CPU; weights arrive on the device. Each entry's tensors are moved
        # to the device of the first weight that needs them and kept there (per device).
        self._on_device: Dict[Tuple[str, torch.device], dict] = {}

    @classmethod
    def from_entry(cls, compute_dtype, profile: Optional[dict] = None):
        if profile is None:
            raise ValueError("fn 'int8' needs a FlashRL int8 profile (setup -p PROFILE); "
                             "use fn 'int8_profile_free' to quantize without one")
        return cls(profile, compute_dtype)

    def has_entry(self, name: str) -> bool:
        return name in self.profile

    def check(self, name: str, weight: torch.Tensor) -> None:
        """Refuse `name` before anything is written when the profile has no entry for it."""
        self._entry(name, None)

    def _entry(self, name, device: Optional[torch.device]):
        try:
            e = self.profile[name]
        except KeyError:
            raise WeightSyncError(f"{name}: not in the int8 profile; the profile was made for "
                                  "another model (re-run `npu-flashrl profile`)") from None
        if device is None:
            return e
        key = (name, device)
        moved = self._on_device.get(key)
        if moved is None:
            moved = {k: (v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v)
                     for k, v in e.items()}
            self._on_device[key] = moved
        return moved

    def quantize(self, name, weight, transposed=False):
        e = self._entry(name, weight.device)
        w = weight.to(self.compute_dtype)
        return kernels.quantize_weight_with_scales(w, e["output_scale"], e["input_scale"],
                                                   transposed=transposed), None

    def transform(self, name, tensor):
        if name not in self.profile:
            return tensor
        e = self._entry(name, tensor.device)
        # Layernorm smoothing: FlashRL computes `w * output_scale * input_scale` then casts.
        out = tensor.to(self.compute_dtype) * e["output_scale"] * e["input_scale"]
        return out.to(e.get("type", self.compute_dtype))
