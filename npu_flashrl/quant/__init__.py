"""Online INT8 quantizers, one registry (`register_quantizer`), shared by every stack line:
they only touch `npu_flashrl.kernels`, never upstream code."""
from npu_flashrl.quant.base import OnlineQuantizer, WeightSyncError
from npu_flashrl.quant.registry import QUANTIZERS, make_quantizer, names, register_quantizer
# Registration order is the order `fn` values are listed in (config.SUPPORTED_FNS).
from npu_flashrl.quant.profile import ProfileQuantizer
from npu_flashrl.quant.per_channel import PerChannelQuantizer
from npu_flashrl.quant.w4a8 import W4A8Quantizer

__all__ = ["OnlineQuantizer", "WeightSyncError", "QUANTIZERS", "make_quantizer", "names",
           "register_quantizer", "ProfileQuantizer", "PerChannelQuantizer", "W4A8Quantizer"]
