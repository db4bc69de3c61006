"""Profile-free INT8: fresh symmetric per-channel weight scales at every sync."""
from __future__ import annotations

from npu_flashrl import kernels
from npu_flashrl.quant.base import OnlineQuantizer
from npu_flashrl.quant.registry import register_quantizer


@register_quantizer("int8_profile_free")
class PerChannelQuantizer(OnlineQuantizer):
    """Profile-free: fresh symmetric per-channel scales on every sync (absmax / 127)."""

    # `quantize(..., finite=[])` hands its NaN / Inf refusal back as a device flag (`kernels`)
    defers_finite_check = True

    def quantize(self, name, weight, transposed=False, finite=None):
        return kernels.quantize_weight_per_channel(weight, self.compute_dtype, transposed=transposed,
                                                   finite=finite)
