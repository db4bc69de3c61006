"""vllm-ascend's W8A8 (static activations) linear scheme (`AscendW8A8LinearMethod`, ModelSlim
checkpoints): int8 weights with per-channel scales and a fixed input scale / offset. It computes
with `deq_scale = input_scale * weight_scale` and an int32 `quant_bias` folded from the float
bias, so both are derived again after new scales and after a bias update (the line's
`commit_extras` and `refresh_static`: what its release derives differs, `npu_flashrl.lines`)."""
from __future__ import annotations

from npu_flashrl import lines
from npu_flashrl.adapters.vllm_ascend.schemes.base import LINEAR
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearScheme
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme

W8A8 = "W8A8"  # vllm-ascend's quant type: its description's value for these layers


@register_scheme(W8A8, LINEAR)
class W8A8StaticLinear(LinearScheme):
    static = True
    patch_name = "ascend_w8a8_static_process_once"
    process_once_why = "post-processing runs once per layer; float bias folded into quant_bias"

    def after_first_processing(self, layer) -> None:
        # a ModelSlim checkpoint's float bias into quant_bias (what the line's release folds)
        lines.current().fold_checkpoint_bias(layer)

    def commit_derived(self, layer) -> None:
        line = lines.current()
        line.commit_extras(layer)
        line.refresh_static(layer)

    def after_bias_update(self, layer) -> None:
        # it computes with quant_bias, not bias: fold the new bias in
        lines.current().refresh_static(layer)
