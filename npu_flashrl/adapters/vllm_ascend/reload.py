"""In-place, bucket-safe INT8 weight reload for vllm-ascend's quantized linear and fused-MoE layers.

`Int8WeightLoader` replaces `model.load_weights` and is the one lifecycle of a weight sync (as
vLLM's `model_loader/reload/` has one: begin / load / end, the sync's state in one dataclass,
`sync.SyncState`). Before `process_weights_after_loading` (cold load) it quantizes the stream and
hands it to vLLM's own loaders. After it, every call belongs to a weight sync (begun by the first
call after the previous sync ended, ended by `end_sync`), which checks each tensor (`validate`,
`wire` for pre-quantized INT8-wire pairs), stages this rank's shard of each quantized layer
through the layer's own weight loader (the layer's scheme, `schemes/`) and, once all shards of
that layer arrived in this sync, writes it IN PLACE into the processed parameters, plus the scale
and every derived copy (the scheme asks the line). No new parameter storage, no second
post-processing, data pointers unchanged. The quantizers (how a full-precision tensor becomes
int8) are `npu_flashrl.quant`.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl import lines
from npu_flashrl.adapters.vllm_ascend import schemes
from npu_flashrl.adapters.vllm_ascend.schemes import LinearTarget  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.linear import find_linear_targets as find_targets
from npu_flashrl.adapters.vllm_ascend.sync import Consistency, SyncState, failure_reason, short_list
from npu_flashrl.adapters.vllm_ascend.validate import Validator
from npu_flashrl.adapters.vllm_ascend.wire import WireReceiver
from npu_flashrl.quant import OnlineQuantizer, WeightSyncError

logger = get_logger(__name__)
# the quant types the INT8 quantizers serve (a quantizer's `serves` says otherwise)
INT8_QUANT_TYPES = (schemes.W8A8_DYNAMIC, schemes.W8A8)


class Int8WeightLoader:
    """The INT8 rollout model's `load_weights`: quantizes incoming HF tensors online.

    One instance per vLLM model. A *sync* is everything between two `end_sync()` calls; it may
    arrive as any number of `load_weights` calls in any split and order.

    What a failed sync leaves: a list/dict call is checked whole (form, names, shapes, dtypes,
    NaN/Inf in the rollout dtype, profile entries, INT8-wire pairs) before anything of it is
    written. A streamed call (generator) is checked item by item; if it fails after something of
    the sync was written, the model holds weights of two syncs: it is marked inconsistent, the
    end of the sync raises saying so, and the model's forward raises until a complete sync
    (every parameter, no failure) ends cleanly.
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
        self.experts = schemes.find_targets(model, schemes.MOE)
        self.validator = Validator(model, self.targets, self.experts)
        layers = self._layers()
        # What a complete sync writes: every target layer and every float parameter outside
        # them (plus the targets' float biases); checkpoint-only tensors (scales) are not pushed.
        self.required_floats = {n for n in self.validator.params
                                if n.rsplit(".", 1)[0] not in layers or n.endswith(".bias")}
        self.required_layers = set(layers)
        self.consistency = Consistency(model, layers.values())
        self.state: Optional[SyncState] = None  # the sync in progress (None: none begun)
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
        is_processed = lines.current().is_processed
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
        serves = getattr(self.quantizer, "serves", INT8_QUANT_TYPES)
        for layer in self._layers().values():
            if layer.scheme.quant_type not in serves:
                raise WeightSyncError(
                    f"{layer.path}: a vllm-ascend {layer.scheme.quant_type} layer, and fn "
                    f"{self.quantizer.name!r} quantizes for {'/'.join(serves)} layers only; use "
                    f"a checkpoint of {'/'.join(serves)} layers, or the fn of "
                    f"{layer.scheme.quant_type} layers")
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

    def begin_sync(self) -> SyncState:
        """The state of the sync in progress, begun now if none is."""
        if self.state is None:
            self.state = SyncState(wire=WireReceiver(self.validator.target, self.quantizer))
        return self.state

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        # Until vLLM's layerwise reload is finalized every tensor is its (the float ones arriving
        # after the last quantized layer was processed again too): none of it begins a sync.
        layerwise = lines.current().layerwise_reload_active(self.model)
        if layerwise or not self.processed():
            # A layer that was processed before and is not now was put back into its checkpoint
            # layout by vLLM's layerwise reload, which holds the tensors it is given until the
            # layer is complete, possibly past this call: give it copies, not the caller's
            # (bucket) tensors. A cold load from disk needs no copy.
            reloading = layerwise or any(getattr(t.layer, "_npu_flashrl_processed", False)
                                         for t in self.targets.values())
            return self._original(self._cold_stream(weights, copy=reloading))
        self.begin_sync()
        return self._load(weights)

    def end_sync(self, partial: bool = False) -> List[str]:
        """End the current sync: [] when everything arrived since the last complete sync (or the
        sync is declared `partial` and clean); otherwise a WeightSyncError naming what failed or
        never arrived (see `_end`)."""
        self.begin_sync()
        try:
            return self._end(partial)
        finally:
            self.state = None

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
        if self.state is None:
            return {}
        return {**self.state.staged.received(), **self.state.wire.received()}

    def staging_bytes(self) -> int:
        """Bytes held by staged, uncommitted layers of this sync (MoE: one layer's int8 experts
        per layer being received)."""
        st = self.state
        return st.staged.nbytes() + st.wire.nbytes() if st is not None else 0

    def quantize(self, target, name: str, tensor: torch.Tensor):
        """The payload of one pushed projection / expert shard (its scheme's: W8A8 int8 + scale,
        int8 in [in, out] memory, the processed layout, so a commit is a memcpy); the
        quantizer's refusals name it."""
        try:
            return target.scheme.quantize(self.quantizer, name, tensor)
        except WeightSyncError:
            raise
        except ValueError as exc:
            raise WeightSyncError(f"{name}: {exc}; refusing the sync") from None

    # ------------------------------------------------------------------ a sync: load
    def _load(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        validator, st = self.validator, self.state
        if isinstance(weights, dict):
            weights = list(weights.items())
        checked = isinstance(weights, (list, tuple))
        loaded: Set[str] = set()
        buffer: List[Tuple[str, torch.Tensor]] = []
        buffered = 0
        limit = self.passthrough_buffer_bytes
        seen: dict = {}
        try:
            if checked:
                # refuse a bad call before writing anything of it
                weights = [validator.item(i, w) for i, w in enumerate(weights)]
                halves: dict = {}  # wire weight -> [int8, scale] once this call brings a half
                for i, (name, tensor) in enumerate(weights):
                    validator.once(name, i, seen)
                    self._once_per_sync(name)
                    wired = st.wire.weight_of(name, tensor)
                    if wired is None:
                        validator.check(name, tensor, self.quantizer)
                    else:
                        st.wire.validate(name, wired, tensor)
                        which = st.wire.half(name, wired)
                        if which is not None:
                            halves.setdefault(wired, st.wire.held(wired))[which] = tensor
                for wired, (q, scale) in halves.items():  # pairs this call completes
                    if q is not None and scale is not None:
                        st.wire.check_pair(wired, q, scale)
            for i, item in enumerate(weights):
                name, tensor = item if checked else validator.item(i, item)
                st.items += 1
                if not checked:
                    validator.once(name, i, seen)
                self._once_per_sync(name, record=True)
                wired = st.wire.weight_of(name, tensor)
                if wired is not None:  # INT8 wire: pre-quantized on the trainer (wire.py)
                    if not checked:
                        st.wire.validate(name, wired, tensor)
                    loaded |= self._take_wire(name, wired, tensor, borrowed=checked)
                    continue
                target = validator.target(name)
                if not checked:
                    # streamed: the quantizer finds NaN/Inf in projections during its own pass
                    validator.check(name, tensor, self.quantizer, values=target is None)
                if target is not None:
                    if self._stage(target, name, tensor):
                        loaded.add(name)
                    continue
                size = tensor.numel() * tensor.element_size()
                if buffer and buffered + size > limit:
                    loaded |= self._flush(buffer)
                    buffered = 0
                buffer.append((name, self.quantizer.transform(name, tensor)))
                buffered += size
                del tensor, item  # the buffer holds the only reference we keep
                if buffered >= limit:
                    loaded |= self._flush(buffer)
                    buffered = 0
            if buffer:
                loaded |= self._flush(buffer)
            st.wire.keep()
        except BaseException as exc:  # KeyboardInterrupt / CancelledError too: re-raised as is
            self._fail(exc)
            raise
        finally:
            st.calls += 1
        return loaded

    def _once_per_sync(self, name: str, record: bool = False) -> None:
        """Refuse a name an earlier call of this sync brought (two buckets with one tensor: the
        last copy would otherwise win without a word)."""
        first = self.state.names.get(name)
        if first is not None and first != self.state.calls:
            raise WeightSyncError(
                f"{name}: arrived twice in one weight sync (load_weights calls {first + 1} and "
                f"{self.state.calls + 1} of this sync, e.g. two buckets); a sync sends each tensor once")
        if record:
            self.state.names[name] = self.state.calls

    def _stage(self, target, name: str, tensor: torch.Tensor) -> bool:
        """Quantize and stage one shard; commit its layer once every shard this rank holds
        arrived. False for an expert this rank does not hold (checked, then dropped)."""
        if not target.holds(name):
            return False
        return self.stage_payload(target, name, self.quantize(target, name, tensor))

    def stage_payload(self, target, name: str, payload, in_place: bool = False) -> bool:
        """Stage one shard already quantized (its scheme's payload: for W8A8 int8 [out, in] and an
        fp32 scale [out] or None: keep the scales), the float path's or the INT8 wire's pair
        (`in_place`: final, checked values its layer may write straight into the live weight);
        commit its layer once every shard this rank holds arrived. False for an expert this
        rank does not hold."""
        if not target.holds(name):
            return False
        if not payload.with_scale and target.scheme.needs_scales:
            # the profile quantizer keeps scales: refused at attach for MoE
            raise WeightSyncError(f"{name}: {self.quantizer.name} gives no expert scales")
        if self.state.staged.open(target, payload.with_scale, in_place).in_place:
            # the live layer holds this shard from now on, its other shards until they come:
            # any failure of the sync from here on leaves the model refusing to generate
            self.state.wrote = True
        done = self.state.staged.stage(target, name, payload)
        if done is not None:
            self.state.wrote = True
            self.state.layers.add(target.path)
            done.commit()
        return True

    def _take_wire(self, name: str, weight_name: str, tensor: torch.Tensor,
                   borrowed: bool) -> Set[str]:
        """One INT8-wire tensor: its projection is staged once its int8 and scale both arrived."""
        # a list call (borrowed) checked every pair it completes before writing anything
        loaded, pair = self.state.wire.take(name, weight_name, tensor, borrowed, pair_checked=borrowed)
        if pair is not None:
            target = self.validator.target(weight_name)
            payload = target.scheme.from_wire(*pair)
            if not self.stage_payload(target, weight_name, payload, in_place=True):
                return set()  # an expert another rank holds: checked, then dropped
        return loaded

    def _flush(self, buffer: List[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Write buffered non-projection tensors through vLLM's loaders and empty the buffer."""
        names = [n for n, _ in buffer]
        self.state.wrote = True
        try:
            loaded = self._original(iter(buffer))
        except AssertionError as exc:  # validated above; a loader's own rule we could not see
            raise WeightSyncError(f"{names[0] if len(names) == 1 else names}: does not fit the "
                                  f"rollout model ({str(exc) or 'a vLLM weight loader assertion'})") from None
        finally:
            buffer.clear()
        self.state.floats.update(r for r in map(self.validator.resolve, names) if r)
        self._refresh_static_biases(names)
        return set(loaded) if loaded is not None else set(names)

    def _refresh_static_biases(self, names) -> None:
        """What a layer's scheme derives from its float bias (static W8A8: quant_bias)."""
        for name in names:
            if name.endswith(".bias"):
                target = self.targets.get(name[: -len("bias")] + "weight")
                if target is not None:
                    target.scheme.after_bias_update(target.layer)

    def _fail(self, exc: BaseException) -> None:
        """A load of this sync raised: its staged (uncommitted) layers are dropped and keep their
        previous weights; anything already written makes the model inconsistent."""
        self.state.staged.drop()
        self.state.wire.drop()
        self.state.names.clear()  # what was staged is dropped: a retry of this sync sends it again
        if self.state.failure is None:
            self.state.failure = failure_reason(exc)
        if self.state.wrote:
            self.consistency.mark(failure_reason(exc))

    # ------------------------------------------------------------------ a sync: end
    def _not_arrived(self) -> List[str]:
        """Every quantized layer and float parameter that no sync wrote since the model last held
        one complete set of weights (this one included), as HF names where they have one."""
        c = self.consistency
        layers = self.required_layers - c.layers - self.state.layers
        floats = self.required_floats - c.floats - self.state.floats
        return list(dict.fromkeys(self.names_of(layers, floats)))

    def _end(self, partial: bool = False) -> List[str]:
        """End this sync: [] when it is complete (or declared `partial` and clean); otherwise a
        WeightSyncError naming what failed or never arrived, saying whether the model holds
        weights of two syncs (then it refuses to generate until a complete sync)."""
        consistency = self.consistency
        # a wire half missing is also its layer's missing shard: each name once
        half = self.state.wire.arrived_halves()
        missing = list(dict.fromkeys(self.state.staged.missing() + self.state.wire.missing()))
        self.state.staged.drop()
        self.state.wire.drop()
        failure, empty = self.state.failure, self.state.items == 0 and self.state.failure is None
        if failure is None and missing:
            failure = (f"{len(missing)} shard(s) {'never arrived' if self.state.wrote else 'missing'}: "
                       f"{short_list(missing)}")
            if half:
                failure += (f" (INT8 wire: {short_list(half, 4)} came without the other half of "
                            "its pair; the INT8 wire sends each projection's int8 weight and its "
                            "weight_scale, a float sync floating-point tensors to quantize online)")
        elif failure is None and empty:
            if partial:
                logger.warning("npu_flashrl: a partial weight sync ended with nothing arrived "
                               "(no load_weights call, or only empty ones); the model keeps its "
                               "previous weights")
                return []
            failure = ("nothing arrived (no load_weights call, or only empty ones) since the "
                       "last end of a sync")
        elif failure is None and not partial:
            gone = self._not_arrived()
            if gone:
                failure = (f"{len(gone)} tensor(s) never arrived since the last complete sync: "
                           f"{short_list(gone, 16)} (a partial sync on purpose is declared: "
                           "end_weight_sync(model, partial=True))")
        if failure is not None:
            if self.state.wrote:  # what arrived holds new weights, the rest old ones
                consistency.mark(failure)
            tail = ("the model holds weights of two syncs and refuses to generate until a "
                    "complete sync succeeds" if consistency.reason is not None
                    else "nothing of it was written; the model keeps its previous weights")
            raise WeightSyncError(f"weight sync failed: {failure}; {tail}")
        consistency.layers |= self.state.layers
        consistency.floats |= self.state.floats
        if not self._not_arrived():
            if consistency.reason is not None:
                logger.info("npu_flashrl: a complete weight sync replaced the mixed weights; the "
                            "model generates again")
            consistency.clear()
        return []

    # ------------------------------------------------------------------ cold load
    def _cold_stream(self, weights, copy: bool = False):
        """Before post-processing: float projections in the stream become what their scheme's
        checkpoint carries (`Scheme.checkpoint_items`: for W8A8 the int8 weight, its scale and a
        zero offset) for vLLM's loaders; a quantized checkpoint's tensors pass through, with what
        its scheme expects and the checkpoint may lack (`Scheme.checkpoint_defaults`: the zero
        weight_offset vllm-ascend expects, which compressed-tensors has none of). Those are
        yielded at the end, and only when the stream brought none: the layerwise reload of vLLM
        lines that have one (lines.v0_23_0) counts the elements loaded into a layer, and a second
        offset would make it process the layer before its scales came. The other tensors of a
        W8A8 checkpoint are already what the INT8 model wants (the profile's smoothing is in
        them)."""
        defaults: Dict[str, torch.Tensor] = {}
        seen: Set[str] = set()
        for name, tensor in weights:
            seen.add(name)
            defaults.pop(name, None)
            target = self.targets.get(name) or self.experts.get(name)
            if target is not None and tensor.is_floating_point():
                self.validator.check(name, tensor, self.quantizer, values=False, device=False)  # the quantizer checks values
                payload = target.scheme.quantize(self.quantizer, name, tensor, transposed=False)
                yield from target.scheme.checkpoint_items(name, payload)
                continue
            owner = self._checkpoint_owner(name)
            if owner is not None:
                yield name, tensor.clone() if copy else tensor
                defaults.update((n, t) for n, t in owner.scheme.checkpoint_defaults(name, tensor).items()
                                if n not in seen)
                continue
            out = tensor if self.prequantized_checkpoint else self.quantizer.transform(name, tensor)
            yield name, out.clone() if copy and out is tensor else out
        yield from defaults.items()

    def _checkpoint_owner(self, name: str):
        """The quantized layer whose checkpoint scale `name` is (its scheme's checkpoint format
        names it); None for any other tensor."""
        weight = name.rpartition(".")[0] + ".weight"
        target = self.targets.get(weight) or self.experts.get(weight)
        if target is not None and target.scheme.checkpoint.scale_name(weight) == name:
            return target
        return None


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

