"""vllm-ascend's W8A8 (static activations) linear scheme (`AscendW8A8LinearMethod`, ModelSlim
checkpoints): int8 weights with per-channel scales and a fixed input scale / offset. It computes
with `deq_scale = input_scale * weight_scale` and an int32 `quant_bias` folded from the float
bias, so both are derived again after new scales and after a bias update (the line's
`commit_extras` and `refresh_static`: what its release derives differs, `npu_flashrl.lines`)."""
from __future__ import annotations

from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend.description import W8A8
from npu_flashrl.adapters.vllm_ascend.schemes.base import LINEAR
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearScheme
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme


@register_scheme(W8A8, LINEAR)
class W8A8StaticLinear(LinearScheme):
    static = True

    def method_class(self, line) -> type:
        return line.method_classes()[0]

    def commit_derived(self, layer) -> None:
        line = _layout.current()
        line.commit_extras(layer)
        line.refresh_static(layer)

    def after_bias_update(self, layer) -> None:
        # it computes with quant_bias, not bias: fold the new bias in
        _layout.current().refresh_static(layer)
