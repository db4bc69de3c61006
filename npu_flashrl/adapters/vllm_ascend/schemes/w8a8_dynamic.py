"""vllm-ascend's W8A8_DYNAMIC linear scheme (`AscendW8A8DynamicLinearMethod`): int8 weights with
per-channel scales, activations quantized per token at run time. After new scales it derives
what post-processing derives from them (the fp32 scale copy, a zero offset: the line's
`commit_extras`). The INT8 wire sends it int8 + per-channel scale (`schemes.base.PER_CHANNEL_INT8`)."""
from __future__ import annotations

from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend.description import W8A8_DYNAMIC
from npu_flashrl.adapters.vllm_ascend.schemes.base import LINEAR
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearScheme
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme


@register_scheme(W8A8_DYNAMIC, LINEAR)
class W8A8DynamicLinear(LinearScheme):
    def method_class(self, line) -> type:
        return line.method_classes()[1]

    def commit_derived(self, layer) -> None:
        _layout.current().commit_extras(layer)
