"""vllm-ascend's W8A8_DYNAMIC linear scheme (`AscendW8A8DynamicLinearMethod`): int8 weights with
per-channel scales, activations quantized per token at run time. After new scales it derives
what post-processing derives from them (the fp32 scale copy, a zero offset: the line's
`commit_extras`). The INT8 wire sends it int8 + per-channel scale (`PER_CHANNEL_INT8`)."""
from __future__ import annotations

from npu_flashrl import lines
from npu_flashrl.adapters.vllm_ascend.schemes.base import LINEAR
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearScheme
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme

W8A8_DYNAMIC = "W8A8_DYNAMIC"  # vllm-ascend's quant type: its description's value for these layers


@register_scheme(W8A8_DYNAMIC, LINEAR)
class W8A8DynamicLinear(LinearScheme):
    patch_name = "ascend_w8a8_dynamic_process_once"
    process_once_why = "post-processing runs once per layer and marks its [in,out] layout"

    def commit_derived(self, layer) -> None:
        lines.current().commit_extras(layer)
