"""In-place, bucket-safe INT8 weight reload for vllm-ascend's W8A8 linear and fused-MoE layers.

`Int8WeightLoader` replaces `model.load_weights`. Before `process_weights_after_loading` (cold
load) it quantizes the stream and hands it to vLLM's own loaders. After it, every call belongs
to a weight sync (`sync.WeightSync`: begun by the first call after the previous sync ended,
ended by `end_sync`), which checks each tensor (`validate`), stages this rank's shard of each
quantized layer through the layer's own weight loader (`staging`) and, once all shards of that
layer arrived in this sync, writes it IN PLACE into the processed parameters, plus the scale and
every derived copy (asked of the line's `layout`). No new parameter storage, no second
post-processing, data pointers unchanged. The quantizers (how a full-precision tensor becomes
int8) are `npu_flashrl.quant`.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend import experts as _experts
from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend.sync import Consistency, WeightSync
from npu_flashrl.adapters.vllm_ascend.targets import LinearTarget, find_targets  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.validate import Validator
from npu_flashrl.quant import OnlineQuantizer, WeightSyncError

logger = get_logger(__name__)


class Int8WeightLoader:
    """The INT8 rollout model's `load_weights`: quantizes incoming HF tensors online.

    One instance per vLLM model. A *sync* is everything between two `end_sync()` calls; it may
    arrive as any number of `load_weights` calls in any split and order (see `WeightSync` for
    what a failed sync leaves).
    """

    # Non-projection tensors of a streamed sync are written in small groups: at most this many
    # bytes are held (or one tensor, when it alone is larger), never the whole stream.
    passthrough_buffer_bytes = 64 << 20

    def __init__(self, model: torch.nn.Module, quantizer: OnlineQuantizer, original_load_weights,
                 prequantized_checkpoint: bool = False):
        self.model = model
        self.quantizer = quantizer
        self._original = original_load_weights
        # The cold-loaded checkpoint is already W8A8 (its layernorms already smoothed): the
        # cold stream must not transform it again.
        self.prequantized_checkpoint = prequantized_checkpoint
        self.targets = find_targets(model)
        # fused-MoE experts (W8A8_DYNAMIC): HF expert name -> its layer
        self.experts = _experts.find_expert_targets(model)
        self.validator = Validator(model, self.targets, self.experts)
        layers = self._layers()
        # What a complete sync writes: every target layer and every float parameter outside
        # them (plus the targets' float biases); checkpoint-only tensors (scales) are not pushed.
        self.required_floats = {n for n in self.validator.params
                                if n.rsplit(".", 1)[0] not in layers or n.endswith(".bias")}
        self.required_layers = set(layers)
        self.consistency = Consistency(model, layers.values())
        self.sync: Optional[WeightSync] = None  # the sync in progress (None: none begun)
        self.check_quantizer()

    # ------------------------------------------------------------------ public API
    def _layers(self) -> Dict[str, object]:
        """Every quantized layer (linear and fused-MoE) by path."""
        out = {t.path: t for t in self.targets.values()}
        out.update((t.path, t) for t in self.experts.values())
        return out

    @property
    def inconsistent(self) -> Optional[str]:
        """Why the model holds weights of two syncs (None: it does not)."""
        return self.consistency.reason

    def processed(self) -> bool:
        layers = [t.layer for t in self._layers().values()]
        is_processed = _layout.current().is_processed
        return bool(layers) and all(is_processed(l) for l in layers)

    def check_quantizer(self) -> None:
        """Refuse a quantizer that cannot handle every projection of this model (a profile made
        for another model, or FlashRL's dense-only profile on a MoE model) now, before any sync
        writes anything."""
        if self.experts and getattr(self.quantizer, "dense_only", False):
            example = next(iter(self.experts))
            raise WeightSyncError(
                f"{example}: {type(self.model).__name__} is a MoE model and fn "
                f"{self.quantizer.name!r} (FlashRL's int8 profile) knows the dense projections "
                f"only ({len(self.experts)} expert weights have no profile entry); use fn "
                "'int8_profile_free' (fresh per-channel scales per expert at every sync)")
        bad = []
        for name in self.targets:
            try:
                self.quantizer.check(name, None)
            except WeightSyncError:
                bad.append(name)
        if bad:
            raise WeightSyncError(
                f"{bad[0]}: not in the {self.quantizer.name} profile ({len(bad)} of "
                f"{len(self.targets)} projections missing); the profile was made for another "
                "model (re-run `npu-flashrl profile`)")
        # what the quantizer needs beyond the projections (FlashRL's profile: an entry for every
        # layernorm, of the model's shapes), checked as `npu-flashrl verify` checks it
        shapes = {name: t.full_shape(name) for name, t in self.targets.items()}
        shapes.update((n, tuple(p.shape)) for n, p in self.validator.params.items()
                      if n.rsplit(".", 1)[0] not in self._layers())
        self.quantizer.check_model(shapes, f"the rollout model ({type(self.model).__name__})")

    def begin_sync(self) -> WeightSync:
        """The sync in progress, begun now if none is."""
        if self.sync is None:
            self.sync = WeightSync(self)
        return self.sync

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        if not self.processed():
            # A layer that was processed before and is not now was put back into its checkpoint
            # layout by vLLM's layerwise reload, which holds the tensors it is given until the
            # layer is complete, possibly past this call: give it copies, not the caller's
            # (bucket) tensors. A cold load from disk needs no copy.
            reloading = any(getattr(t.layer, "_npu_flashrl_processed", False)
                            for t in self.targets.values())
            return self._original(self._cold_stream(weights, copy=reloading))
        return self.begin_sync().load(weights)

    def end_sync(self, partial: bool = False) -> List[str]:
        """End the current sync: [] when everything arrived since the last complete sync (or the
        sync is declared `partial` and clean); otherwise a WeightSyncError naming what failed or
        never arrived (see `WeightSync.end`)."""
        sync, self.sync = self.begin_sync(), None
        return sync.end(partial)

    def names_of(self, layers: Set[str], floats: Set[str]) -> List[str]:
        """HF names of quantized layers (by path) and float parameters, in the model's order."""
        order = {n: i for i, n in enumerate(self.validator.params)}
        by_path = self._layers()
        keyed = []
        for path in layers:
            t = by_path[path]
            first = f"{path}.weight" if f"{path}.weight" in order else f"{path}.w13_weight"
            names = t.shard_names() if hasattr(t, "shard_names") else sorted(t.local)
            keyed += [(order.get(first, -1), i, n) for i, n in enumerate(names)]
        keyed += [(order.get(n, -1), 0, n) for n in floats]
        return [n for _, _, n in sorted(keyed)]

    def pending(self) -> Dict[str, List[str]]:
        """Staged (uncommitted) layers of the sync in progress: layer path -> shards received
        (INT8 wire: projection weight -> the halves of its pair received)."""
        if self.sync is None:
            return {}
        return {**self.sync.staged.received(), **self.sync.wire.received()}

    def staging_bytes(self) -> int:
        """Bytes held by staged, uncommitted layers of this sync (MoE: one layer's int8 experts
        per layer being received)."""
        return self.sync.staged.nbytes() + self.sync.wire.nbytes() if self.sync is not None else 0

    def quantize(self, name: str, tensor: torch.Tensor):
        """(int8, scale) of one pushed projection / expert shard, produced in [in, out] memory
        (the processed layout, so a commit is a memcpy); the quantizer's refusals name it."""
        try:
            return self.quantizer.quantize(name, tensor, transposed=True)
        except WeightSyncError:
            raise
        except ValueError as exc:
            raise WeightSyncError(f"{name}: {exc}; refusing the sync") from None

    # ------------------------------------------------------------------ cold load
    def _cold_stream(self, weights, copy: bool = False):
        """Before post-processing: quantize float projections in the stream for vLLM's loaders;
        a w8a8 checkpoint's int8 weights pass through and get the zero weight_offset vllm-ascend
        expects (compressed-tensors has none). That offset is yielded at the end, and only when
        the stream brought none: the layerwise reload of vLLM lines that have one (lines.v0_23_0) counts the elements loaded into
        a layer, and a second offset would make it process the layer before its scales came.
        The other tensors of a W8A8 checkpoint are already what the INT8 model wants (the
        profile's smoothing is in them)."""
        missing_offsets: Dict[str, torch.Tensor] = {}
        seen_offsets: Set[str] = set()
        for name, tensor in weights:
            if name.endswith(".weight_offset"):
                seen_offsets.add(name)
                missing_offsets.pop(name, None)
            target = self.targets.get(name) or self.experts.get(name)
            if target is not None and tensor.is_floating_point():
                self.validator.check(name, tensor, self.quantizer, values=False, device=False)  # the quantizer checks values
                q, scale = self.quantizer.quantize(name, tensor)
                yield name, q
                if scale is not None:
                    yield name[: -len("weight")] + "weight_scale", scale.unsqueeze(1)
                    yield name[: -len("weight")] + "weight_offset", torch.zeros_like(scale).unsqueeze(1)
                continue
            weight_name = name[: -len("_scale")]
            if name.endswith(".weight_scale") and (weight_name in self.targets or weight_name in self.experts):
                yield name, tensor.clone() if copy else tensor
                offset = name[: -len("weight_scale")] + "weight_offset"
                if offset not in seen_offsets:
                    missing_offsets[offset] = torch.zeros_like(tensor)
                continue
            out = tensor if self.prequantized_checkpoint else self.quantizer.transform(name, tensor)
            yield name, out.clone() if copy and out is tensor else out
        yield from missing_offsets.items()


def attach(model: torch.nn.Module, quantizer: OnlineQuantizer,
           prequantized_checkpoint: bool = False) -> Int8WeightLoader:
    """Give `model` the INT8 `load_weights` (idempotent; returns the loader).
    `prequantized_checkpoint`: the model is cold-loaded from a W8A8 checkpoint."""
    existing = getattr(model, "_npu_flashrl_loader", None)
    if existing is not None:
        previous, existing.quantizer = existing.quantizer, quantizer
        try:
            existing.check_quantizer()
        except WeightSyncError:
            existing.quantizer = previous
            raise
        return existing
    loader = Int8WeightLoader(model, quantizer, model.load_weights, prequantized_checkpoint)
    model._npu_flashrl_loader = loader
    model.load_weights = loader.load_weights
    logger.debug("npu_flashrl: INT8 weight loader attached to %s (%d quantized projections, %s)",
                 type(model).__name__, len(loader.targets), quantizer.name)
    from npu_flashrl.architectures import warn_if_not_covered

    warn_if_not_covered(type(model).__name__, "INT8 rollout engine build")
    return loader


def end_weight_sync(model: torch.nn.Module, partial: bool = False) -> List[str]:
    """End the model's current weight sync (`Int8WeightLoader.end_sync`). `partial=True`
    declares a sync that sends a subset on purpose: it is not refused for what it left out,
    and what it wrote counts toward the next complete sync."""
    loader = getattr(model, "_npu_flashrl_loader", None)
    if loader is None:
        raise RuntimeError("this model has no npu_flashrl INT8 loader (was npu_flashrl active when "
                           "the rollout engine was built?)")
    return loader.end_sync(partial=partial)

