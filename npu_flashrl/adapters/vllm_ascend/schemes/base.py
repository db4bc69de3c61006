"""What a quantization scheme is to the in-place reload: the ABC every scheme module implements.

A scheme is one vllm-ascend quantization method for one layer type, keyed as vllm-ascend keys its
own scheme table: (quant type, layer type), e.g. ("W8A8_DYNAMIC", "linear"). Its module holds the
quant-type constant and owns, for the layers that run it:

- target detection: `method_class(line)` (the vllm-ascend class a layer's quant method wraps,
  read by key from the line's own table: `StackLine.method_class`) and `targets(model, layers)`
  (HF names -> the layer objects a sync writes into);
- its tensor contract: what one float tensor becomes (`quantize` -> a payload, `Int8Payload` for
  the W8A8 schemes), which tensors its checkpoint carries (`checkpoint_items`,
  `checkpoint_defaults`: the cold load asks it) and its wire format (`wire`, a `WireFormat`: the
  tensor names a pre-quantized projection travels as; None: float wire only);
- the staging layout: `new_staging(target, with_scale)` (where a sync's payloads wait until the
  layer is complete, in the layout `commit()` copies from);
- the derived tensors: `after_first_processing(layer)` at its one post-processing,
  `commit_derived(layer)` after new scales, `after_bias_update(layer)` after a float bias update
  (what post-processing would have derived; asked of the line);
- its run-once patch (`once_patch`: named `patch_name`, on the class the line's table holds).

Every target answers `path`, `layer`, `scheme`, `full_shape(name)`, `holds(name)`,
`weight_device()` and `shard_names()`, which is all validation, staging and the sync ask of it.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.quant.wire import PER_CHANNEL_INT8, WireFormat  # noqa: F401  (re-exported)

LINEAR = "linear"
MOE = "moe"


class UnsupportedScheme(NpuFlashrlError, ValueError):
    """A checkpoint quantization scheme vllm-ascend's W8A8 layers cannot run."""


@dataclasses.dataclass
class Int8Payload:
    """What one float projection (or expert shard) becomes for a W8A8 scheme: int8 `q` (the
    quantizer's [out, in] values, in [in, out] memory for a sync) and its fp32 per-row `scale`
    [out] (None: the quantizer keeps the checkpoint's scales)."""
    q: torch.Tensor
    scale: Optional[torch.Tensor]

    @property
    def with_scale(self) -> bool:
        return self.scale is not None


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

    `stage(name, payload)` loads one quantized shard (its scheme's payload);
    `complete()` / `missing()` / `received` say what arrived; `buffers()` are the bytes held;
    `commit()` writes the layer in place. `in_place`: shards are written into the live layer as
    they are staged (not only at the commit)."""

    in_place = False

    def __init__(self, target):
        self.target = target
        self.received: set = set()

    def stage(self, name: str, payload) -> None:
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
    # the tensors its checkpoint carries beside each weight (the cold load asks `checkpoint_items`)
    checkpoint: ClassVar[WireFormat] = PER_CHANNEL_INT8
    # the quantizer must give fresh scales for it (a profile that keeps the checkpoint's scales
    # cannot serve it)
    needs_scales: ClassVar[bool] = False
    # its run-once patch: name (default `ascend_<quant type>_<layer type>_process_once`) and why
    patch_name: ClassVar[str] = ""
    process_once_why: ClassVar[str] = "post-processing runs once per layer"

    @property
    def key(self) -> Tuple[str, str]:
        return self.quant_type, self.layer_type

    # ------------------------------------------------------------------ detection
    def method_class(self, line) -> Optional[type]:
        """vllm-ascend's class of this scheme on `line` (an `npu_flashrl.lines.StackLine`), read
        by key from the line's own table; None: that release has none."""
        return line.method_class(self.quant_type, self.layer_type)

    def claims(self, inner, line) -> bool:
        """Whether a layer whose scheme object is `inner` runs this scheme."""
        cls = self.method_class(line)
        return cls is not None and isinstance(inner, cls)

    @abc.abstractmethod
    def targets(self, model: torch.nn.Module, layers: Sequence[Tuple[str, torch.nn.Module]]
                ) -> Dict[str, object]:
        """HF weight name -> target, for `layers` ((path, module) running this scheme)."""

    def check_target(self, target, quantizer) -> None:
        """Refuse, when the sync is attached (engine build, before any load), a layer of this
        scheme that `quantizer` cannot serve as built (default: every layer it claims is fine)."""

    # ------------------------------------------------------------------ tensor contract
    def quantize(self, quantizer, name: str, tensor: torch.Tensor, transposed: bool = True):
        """What one float tensor becomes: the payload its staging takes (`transposed`: int8 in
        the processed [in, out] memory, as a sync stages it; the cold load wants [out, in]). A
        float64 tensor is cast to the compute dtype first, which every quantizer does first."""
        if tensor.dtype == torch.float64:
            tensor = tensor.to(quantizer.compute_dtype)
        q, scale = quantizer.quantize(name, tensor, transposed=transposed)
        return Int8Payload(q, scale)

    def from_wire(self, q: torch.Tensor, scale: torch.Tensor):
        """The payload of a checked INT8-wire pair (scale [out] fp32)."""
        return Int8Payload(q, scale)

    def checkpoint_items(self, name: str, payload) -> Iterator[Tuple[str, torch.Tensor]]:
        """The checkpoint tensors of one quantized weight (`payload` from `quantize`, untransposed),
        as vLLM's loaders read them at the cold load: int8 weight, [out, 1] scale and zero offset."""
        yield name, payload.q
        if payload.scale is not None:
            scale = payload.scale.unsqueeze(1)
            yield self.checkpoint.scale_name(name), scale
            yield self.checkpoint.offset_name(name), torch.zeros_like(scale)

    def checkpoint_defaults(self, name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Checkpoint tensors vllm-ascend expects that a checkpoint may lack, given one it carries
        (`name`): a zero offset beside a W8A8 scale (compressed-tensors has none)."""
        if name.endswith("." + self.checkpoint.scale_suffix):
            return {self.checkpoint.offset_name(self.checkpoint.weight_of(name)): torch.zeros_like(tensor)}
        return {}

    # ------------------------------------------------------------------ staging and derived
    @abc.abstractmethod
    def new_staging(self, target, with_scale: bool, in_place: bool = False) -> LayerStaging:
        """An empty staging of `target` for one sync (`with_scale`: the quantizer writes scales;
        `in_place`: the shards are final, checked values that may go straight into the live
        layer; a scheme that does not do so returns a buffered staging, `LayerStaging.in_place`)."""

    def after_first_processing(self, layer) -> None:
        """After vllm-ascend's one post-processing of the layer (its run-once patch): what the
        reload relies on that upstream leaves out (default none)."""

    @abc.abstractmethod
    def commit_derived(self, layer) -> None:
        """After new weights and scales were written in place: what post-processing derives."""

    def after_bias_update(self, layer) -> None:
        """After a float bias of the layer was written: what it derives from it (default none)."""

    # ------------------------------------------------------------------ patch
    def method_patches(self, line) -> list:
        """Patches of its method class beyond the run-once one, on `line` (default none)."""
        return []

    def once_patch(self, line):
        """Its run-once patch on `line` (`StackLine.once_patch`)."""
        name = self.patch_name or f"ascend_{self.quant_type.lower()}_{self.layer_type}_process_once"
        return line.once_patch(name, self.quant_type, self.layer_type, self.process_once_why,
                               after=self.after_first_processing)
