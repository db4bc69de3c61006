"""Profile-free W4A8_DYNAMIC: fresh scales of both levels at every sync, in `kernels.int4`'s
staged ModelSlim format (per-channel int8, then int4 per group of input channels).

The entry's quantizer carries what the rollout's W4A8 layers need of it (the compute dtype); the
int4 quantization itself belongs to their scheme (`adapters/vllm_ascend/schemes/w4a8_dynamic.py`),
which quantizes each projection for the group size its layer was built with. It serves
vllm-ascend's W4A8_DYNAMIC layers only (`serves`): the loader refuses a model with other
quantized layers when the engine builds, and the W8A8 quantizers do not serve W4A8 layers.
"""
from __future__ import annotations

from npu_flashrl.quant.base import OnlineQuantizer, WeightSyncError
from npu_flashrl.quant.registry import register_quantizer

W4A8_DYNAMIC = "W4A8_DYNAMIC"


@register_quantizer("w4a8_profile_free")
class W4A8Quantizer(OnlineQuantizer):
    """Profile-free W4A8_DYNAMIC (int4 weights in groups, two scale levels)."""

    serves = (W4A8_DYNAMIC,)

    def quantize(self, name, weight, transposed=False):
        raise WeightSyncError(f"{name}: fn {self.name!r} quantizes vllm-ascend W4A8_DYNAMIC layers "
                              "only (through their scheme); this projection's layer is not one")
