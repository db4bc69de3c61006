"""What a quantization scheme is to the in-place reload: the ABC every scheme module implements.

A scheme is one vllm-ascend quantization method for one layer type, keyed as vllm-ascend keys its
own `quantization/methods/` registry: (quant type, layer type), e.g. ("W8A8_DYNAMIC", "linear").
Its module owns, for the layers that run it:

- target detection: `method_class(line)` (the vllm-ascend class a layer's quant method wraps) and
  `targets(model, layers)` (HF names -> the layer objects a sync writes into);
- the staging layout: `new_staging(target, with_scale)` (where a sync's shards wait until the
  layer is complete, in the layout `commit()` copies from);
- the derived tensors: `commit_derived(layer)` after new scales, `after_bias_update(layer)` after
  a float bias update (what post-processing would have derived; asked of the line, whose
  `npu_flashrl.lines` module knows what its release derives);
- the wire format: `wire` (what the trainer may send pre-quantized for it; None: float only).

Every target answers `path`, `layer`, `scheme`, `full_shape(name)`, `holds(name)`,
`weight_device()` and `shard_names()`, which is all validation, staging and the sync ask of it.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

LINEAR = "linear"
MOE = "moe"


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """A pre-quantized form the trainer may send for a scheme's projections: `<p>.weight` int8
    [out, in] with `<p>.<scale_suffix>` [out, 1] (one scale per output row); a
    `<p>.<offset_suffix>` is accepted when zero (symmetric)."""
    name: str
    scale_suffix: str = "weight_scale"
    offset_suffix: str = "weight_offset"


# vllm-ascend's W8A8 checkpoint tensors: int8 weight, one fp32 scale per output channel
PER_CHANNEL_INT8 = WireFormat("per-channel int8")

# The template attributes a staging buffer carries, so the layer's weight_loader treats it like
# the parameter it stands for: sharding (output_dim / input_dim / packing) for linear layers,
# quant_method="channel" on scales and is_transposed for fused-MoE ones.
_LOADER_ATTRS = ("output_dim", "input_dim", "packed_dim", "packed_factor",
                 "quant_method", "is_transposed", "load_full_w2")


def stage_param(data: torch.Tensor, template: torch.nn.Parameter) -> torch.nn.Parameter:
    """A buffer the layer's own weight_loader can fill as if it were `template`."""
    p = torch.nn.Parameter(data, requires_grad=False)
    for attr in _LOADER_ATTRS:
        if hasattr(template, attr):
            setattr(p, attr, getattr(template, attr))
    return p


def inner_method(layer):
    """The vllm-ascend scheme object behind a layer's quant method wrapper (None: unquantized)."""
    return getattr(getattr(layer, "quant_method", None), "quant_method", None)


class LayerStaging:
    """One quantized layer of the current sync, staged until every shard this rank holds came.

    `stage(name, q, scale)` loads one quantized shard ([in, out] memory, see the quantizers);
    `complete()` / `missing()` / `received` say what arrived; `buffers()` are the bytes held;
    `commit()` writes the layer in place. `in_place`: shards are written into the live layer as
    they are staged (not only at the commit)."""

    in_place = False

    def __init__(self, target):
        self.target = target
        self.received: set = set()

    def stage(self, name: str, q: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
        raise NotImplementedError

    def complete(self) -> bool:
        raise NotImplementedError

    def missing(self) -> List[str]:
        raise NotImplementedError

    def buffers(self) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError


class Scheme(abc.ABC):
    """One (quant type, layer type) of vllm-ascend the reload can write in place. Registered with
    `registry.register_scheme`; one instance per process."""
    quant_type: ClassVar[str]
    layer_type: ClassVar[str]
    wire: ClassVar[Optional[WireFormat]] = None
    # the quantizer must give fresh scales for it (a profile that keeps the checkpoint's scales
    # cannot serve it)
    needs_scales: ClassVar[bool] = False

    @property
    def key(self) -> Tuple[str, str]:
        return self.quant_type, self.layer_type

    @abc.abstractmethod
    def method_class(self, line) -> type:
        """vllm-ascend's class of this scheme on `line` (an `npu_flashrl.lines.StackLine`)."""

    def claims(self, inner, line) -> bool:
        """Whether a layer whose scheme object is `inner` runs this scheme."""
        return isinstance(inner, self.method_class(line))

    @abc.abstractmethod
    def targets(self, model: torch.nn.Module, layers: Sequence[Tuple[str, torch.nn.Module]]
                ) -> Dict[str, object]:
        """HF weight name -> target, for `layers` ((path, module) running this scheme)."""

    @abc.abstractmethod
    def new_staging(self, target, with_scale: bool, in_place: bool = False) -> LayerStaging:
        """An empty staging of `target` for one sync (`with_scale`: the quantizer writes scales;
        `in_place`: the shards are final, checked values that may go straight into the live
        layer; a scheme that does not do so returns a buffered staging, `LayerStaging.in_place`)."""

    @abc.abstractmethod
    def commit_derived(self, layer) -> None:
        """After new weights and scales were written in place: what post-processing derives."""

    def after_bias_update(self, layer) -> None:
        """After a float bias of the layer was written: what it derives from it (default none)."""
