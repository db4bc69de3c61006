"""The cold load: what the model's `load_weights` gets before its layers are post-processed (the
checkpoint from disk, or vLLM's own layerwise reload), handed on to vLLM's loaders.

Float projections in the stream become what their scheme's checkpoint carries
(`Scheme.checkpoint_items`: for W8A8 the int8 weight, its scale and a zero offset); a quantized
checkpoint's tensors pass through, with what its scheme expects and the checkpoint may lack
(`Scheme.checkpoint_defaults`: the zero weight_offset vllm-ascend expects, which
compressed-tensors has none of). Those are yielded at the end, and only when the stream brought
none: the layerwise reload of vLLM lines that have one (lines.v0_23_0) counts the elements loaded
into a layer, and a second offset would make it process the layer before its scales came. The
other tensors of a W8A8 checkpoint are already what the INT8 model wants (the profile's smoothing
is in them)."""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend.validate import Flagging
from npu_flashrl.quant import WeightSyncError


class ColdLoad:
    """The cold stream of one model (`targets`: its `Targets`; `validator`: its `Validator`).
    `prequantized_checkpoint`: the checkpoint is already W8A8 (its layernorms already smoothed),
    so the stream must not transform it again."""

    def __init__(self, targets, validator, prequantized_checkpoint: bool = False):
        self.targets = targets
        self.validator = validator
        self.prequantized_checkpoint = prequantized_checkpoint

    def stream(self, weights, quantizer, copy: bool = False):
        """`weights` as vLLM's loaders of the quantized model read them (`copy`: the consumer holds
        tensors past this stream's next item, as vLLM's layerwise reload does: copies, not the
        caller's)."""
        defaults: Dict[str, torch.Tensor] = {}
        seen: Set[str] = set()
        # a quantizer that hands its NaN / Inf refusal back as a device flag: read back once, at
        # the end of the stream (no host synchronisation per projection); vLLM's loaders have
        # the stream's weights by then, and the refusal (naming the first bad tensor) fails
        # the load as a refusal mid-stream would
        flags: Optional[List[Tuple[str, torch.Tensor]]] = \
            [] if getattr(quantizer, "defers_finite_check", False) else None
        for name, tensor in weights:
            seen.add(name)
            defaults.pop(name, None)
            target = self.targets.get(name)
            if target is not None and tensor.is_floating_point():
                # the quantizer checks the values
                self.validator.check(name, tensor, quantizer, values=False, device=False)
                if flags is None:
                    payload = target.scheme.quantize(quantizer, name, tensor, transposed=False)
                else:
                    mine: list = []
                    payload = target.scheme.quantize(Flagging(quantizer, mine), name, tensor,
                                                     transposed=False)
                    flags.extend((name, f) for f in mine)
                yield from target.scheme.checkpoint_items(name, payload)
                continue
            owner = self._checkpoint_owner(name)
            if owner is not None:
                yield name, tensor.clone() if copy else tensor
                defaults.update((n, t) for n, t in owner.scheme.checkpoint_defaults(name, tensor).items()
                                if n not in seen)
                continue
            out = tensor if self.prequantized_checkpoint else quantizer.transform(name, tensor)
            yield name, out.clone() if copy and out is tensor else out
        if flags:
            ok = torch.stack([f.reshape(()) for _, f in flags])
            if not bool(ok.all()):  # the stream's one host synchronisation
                bad = flags[ok.tolist().index(False)][0]
                raise WeightSyncError(f"{bad}: contains NaN or Inf (the {quantizer.name} quantizer's "
                                      "check, read back at the end of the load); refusing the load")
        yield from defaults.items()

    def _checkpoint_owner(self, name: str):
        """The quantized layer whose checkpoint scale `name` is (its scheme's checkpoint format
        names it); None for any other tensor."""
        weight = name.rpartition(".")[0] + ".weight"
        target = self.targets.get(weight)
        if target is not None and target.scheme.checkpoint.scale_name(weight) == name:
            return target
        return None

