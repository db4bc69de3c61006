"""The rehearsal's quantized rollout precisions, one row each: the config `fn` a variant's engine
is set up with maps to its row through the quantizer registry (the vllm-ascend quant types the
fn's quantizer serves), and the row says what the verdict asks of it (the dtype its layers'
weight holds, its state check, its limits). A new scheme's rehearsal variant is a row here."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

FN_W4A8 = "w4a8_profile_free"


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str                  # the precision the variant names start with: "int8", "w4a8"
    quant_types: Tuple[str, ...]  # the vllm-ascend quant types its layers hold
    weight_dtype: str          # what layer 0's qkv weight is once loaded
    values: str                # what its quantized values are ("int8", "int4")
    state_check: Callable[[], type]  # the class checking its state after every sync
    max_error: str             # the args attribute: its token_mult_prob_error limit
    max_layer_error: str       # the args attribute: its per-layer output error limit
    above: Optional[str] = None  # a precision whose mismatch this one must exceed (coarser values)


def _int8_check() -> type:
    from npu_flashrl.rehearsal.state import Int8StateCheck

    return Int8StateCheck


def _w4a8_check() -> type:
    from npu_flashrl.rehearsal.state_w4a8 import W4A8StateCheck

    return W4A8StateCheck


INT8 = Precision("int8", ("W8A8_DYNAMIC", "W8A8"), "torch.int8", "int8", _int8_check, "max_error", "max_layer_error")
W4A8 = Precision("w4a8", ("W4A8_DYNAMIC",), "torch.int32", "int4", _w4a8_check, "max_w4a8_error",
                 "max_w4a8_layer_error", above="int8")
PRECISIONS = (INT8, W4A8)


def of_fn(fn: Optional[str]) -> Optional[Precision]:
    """The row of config fn `fn` (None / bf16: None), by the quant types its quantizer serves."""
    if fn is None or fn == "bf16":
        return None
    from npu_flashrl.adapters.vllm_ascend.targets import INT8_QUANT_TYPES
    from npu_flashrl.quant.registry import QUANTIZERS

    serves = tuple(getattr(QUANTIZERS[fn], "serves", INT8_QUANT_TYPES))
    for p in PRECISIONS:
        if set(serves) <= set(p.quant_types):
            return p
    raise ValueError(f"fn {fn!r} serves {'/'.join(serves)} layers: no rehearsal precision covers them")


def of_info(info: Dict[str, Any]) -> Optional[Precision]:
    return of_fn(info.get("fn"))
