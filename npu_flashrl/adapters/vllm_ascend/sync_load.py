"""One `load_weights` call of a weight sync (`SyncLoad`): check, quantize, stage, commit.

Each tensor is checked (`validate`; an INT8-wire tensor by the sync's `WireReceiver`), a
projection (or expert shard) becomes its scheme's payload and is staged through its layer's own
weight loader (`staging`), and a layer is written in place once every shard this rank holds
arrived in this sync; float parameters (norms, embeddings, biases) go through vLLM's own loaders
in small groups. A list/dict call is checked whole before anything of it is written, its value
checks read back in one host synchronisation. A streamed call (generator) is checked item by
item, its value checks (NaN / Inf, the quantizer's refusal, the INT8 wire's scales) read back
twice, not per tensor: before its sync's first write (a stream refused before then leaves the
model as it was) and at the end of the call; a refusal found at the end names the tensor and
finds something of the sync written. No tensor a stream yields is held past the yield that gave
it (what waits for a group's write is copied, once; a deferred check keeps a tensor's extremes,
not the tensor). Any exit from the call after something of the sync was written marks the model
inconsistent (`sync.Consistency`): it refuses to generate, so weights of two syncs are never used."""
from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend.sync import failure_reason
from npu_flashrl.adapters.vllm_ascend.targets import no_moe
from npu_flashrl.adapters.vllm_ascend.validate import DeferredChecks, Flagging
from npu_flashrl.quant import WeightSyncError


class SyncLoad:
    """One load call into the sync `state`. `targets`: the model's `Targets`; `original`: vLLM's
    own `load_weights` (float parameters); `limit`: bytes of float tensors held before a write."""

    def __init__(self, state, validator, targets, quantizer, consistency, original, limit: int):
        self.state, self.validator, self.targets = state, validator, targets
        self.quantizer, self.consistency = quantizer, consistency
        self._original, self.limit = original, limit
        self._held: Optional[_Held] = None  # a list call's deferred checks and commits

    def run(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        validator, st = self.validator, self.state
        if isinstance(weights, dict):
            weights = list(weights.items())
        checked = isinstance(weights, (list, tuple))
        loaded: Set[str] = set()
        buffer: List[Tuple[str, torch.Tensor]] = []
        buffered = 0
        seen: dict = {}
        try:
            if checked:  # refuse a bad call before writing anything of it
                weights, self._held = check_list_call(st, validator, self.quantizer, weights, seen)
            else:  # streamed: value checks read back before the sync's first write and at the end
                self._held = _Held(DeferredChecks(), holds=False,
                                   defers=getattr(self.quantizer, "defers_finite_check", False))
            for i, item in enumerate(weights):
                name, tensor = item if checked else validator.item(i, item)
                st.items += 1
                if not checked:
                    validator.once(name, i, seen)
                once_per_sync(st, name, record=True)
                wired = st.wire.weight_of(name, tensor)
                if wired is not None:  # INT8 wire: pre-quantized on the trainer (wire.py)
                    if not checked:  # a scale's check keeps its extremes, not the tensor
                        st.wire.validate(name, wired, tensor, deferred=self._held.checks, kept=False)
                    loaded |= self._take_wire(name, wired, tensor, borrowed=checked)
                    continue
                target = validator.target(name)
                if not checked:
                    # streamed: the quantizer finds NaN/Inf in projections during its own pass
                    validator.check(name, tensor, self.quantizer, values=target is None,
                                    deferred=self._held.checks)
                if target is not None:
                    if self._stage(target, name, tensor):
                        loaded.add(name)
                    continue
                size = tensor.numel() * tensor.element_size()
                if buffer and buffered + size > self.limit:
                    loaded |= self._flush(buffer)
                    buffered = 0
                out = self.quantizer.transform(name, tensor)
                if not checked and out is tensor:
                    # a streamed tensor may be a view of the caller's buffer, refilled for its
                    # next item: what waits for the flush is copied, once (vLLM's own loader
                    # copies each tensor before it pulls the next)
                    out = tensor.clone()
                    st.copied_bytes += size
                buffer.append((name, out))
                buffered += size
                del tensor, item  # the buffer holds the only reference we keep
                if buffered >= self.limit:
                    loaded |= self._flush(buffer)
                    buffered = 0
            self._settle()  # the call's checks (a streamed call's last read-back), then its last floats
            if buffer:
                loaded |= self._flush(buffer)
            st.wire.keep()
        except BaseException as exc:  # KeyboardInterrupt / CancelledError too: re-raised as is
            self._fail(exc)
            raise
        finally:
            self._held = None
            st.calls += 1
        return loaded

    def _stage(self, target, name: str, tensor: torch.Tensor) -> bool:
        """Quantize and stage one shard (False: an expert this rank does not hold: checked, then
        dropped). Its payload is its scheme's; the quantizer's refusals name it."""
        if not target.holds(name):
            return False
        held = self._held
        if held is None or not held.defers:
            return self.stage_payload(target, name, quantize(target, self.quantizer, name, tensor))
        flags: list = []
        payload = quantize(target, Flagging(self.quantizer, flags), name, tensor)
        for flag in flags:
            if held.holds:  # a list call's tensor: the quantizer's refusal re-run if its flag fails
                held.checks.add(flag, lambda: quantize(target, self.quantizer, name, tensor))
            else:  # streamed (the tensor may be refilled): the quantizer's flag is its refusal
                held.checks.add(flag, lambda: _refuse_quantized(self.quantizer, name))
        return self.stage_payload(target, name, payload)

    def stage_payload(self, target, name: str, payload, in_place: bool = False) -> bool:
        """Stage one shard already quantized (its scheme's payload: for W8A8 int8 [out, in] and an
        fp32 scale [out] or None: keep the scales), the float path's or the INT8 wire's pair
        (`in_place`: final, checked values its layer may write straight into the live weight);
        commit its layer once every shard this rank holds arrived. False for an expert this
        rank does not hold."""
        st = self.state
        if not target.holds(name):
            return False
        if not payload.with_scale and target.scheme.needs_scales:
            # the profile quantizer keeps scales: refused at attach for MoE
            raise no_moe(self.quantizer, name, f"{target.path} is a fused-MoE layer")
        if st.staged.open(target, payload.with_scale, in_place).in_place:
            # the live layer holds this shard from now on, its other shards until they come:
            # any failure of the sync from here on leaves the model refusing to generate
            self._before_write()
            st.wrote = True
        done = st.staged.stage(target, name, payload)
        held = self._held
        if done is not None and held is not None and held.holds and not done.in_place:
            held.commits.append(done)  # committed once the call's checks are read back
        elif done is not None:
            self._before_write()
            st.wrote = True
            st.layers.add(target.path)
            done.commit()
        return True

    def _take_wire(self, name: str, weight_name: str, tensor: torch.Tensor,
                   borrowed: bool) -> Set[str]:
        """One INT8-wire tensor: its projection is staged once its int8 and scale both arrived."""
        # a list call (borrowed) checked every pair it completes before writing anything; a
        # streamed call's pair checks are read back with its others (on the scales)
        deferred = None if borrowed or self._held is None else self._held.checks
        loaded, pair = self.state.wire.take(name, weight_name, tensor, borrowed, pair_checked=borrowed,
                                            deferred=deferred)
        if pair is not None:
            target = self.validator.target(weight_name)
            if not self.stage_payload(target, weight_name, target.scheme.from_wire(*pair), in_place=True):
                return set()  # an expert another rank holds: checked, then dropped
        return loaded

    def _flush(self, buffer: List[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Write buffered non-projection tensors through vLLM's loaders and empty the buffer;
        then what a layer's scheme derives from its float bias (static W8A8: quant_bias)."""
        self._before_write()  # a list call's deferred checks first: nothing of it is written before
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
        for name in names:
            target = self.targets.bias_owner(name)
            if target is not None:
                target.scheme.after_bias_update(target.layer)
        return set(loaded) if loaded is not None else set(names)

    def _settle(self) -> None:
        """The call's deferred checks read back, then the layers a list call completed committed."""
        if self._held is not None:
            self._held.settle(self.state)

    def _before_write(self) -> None:
        """Before anything reaches the live weights: a list call's checks are all read back (it
        writes nothing before); a streamed call's before its sync's first write (a stream
        refused before then leaves the model as it was), and after that at the call's end (one
        host synchronisation for the rest of the call, not one per tensor or layer: a refusal
        then finds something of the sync written and leaves the model refusing to generate,
        so weights of two syncs are never used)."""
        held = self._held
        if held is not None and (held.holds or not self.state.wrote):
            held.settle(self.state)

    def _fail(self, exc: BaseException) -> None:
        fail_call(self.state, self.consistency, exc)


def check_list_call(st, validator, quantizer, weights, seen: dict) -> Tuple[list, Optional[_Held]]:
    """A list call, checked whole (every tensor, and every INT8-wire pair it completes); its
    value checks are read back together, in one host synchronisation (`DeferredChecks`),
    and a failing one re-runs to refuse by name, before anything of the call is written. A
    call of float tensors only, with a quantizer that hands its NaN / Inf refusal back as a
    device flag (`defers_finite_check`), has no separate value pass over its projections:
    the quantizer's flags join the call's checks, read back (`SyncLoad._settle`) before any
    layer the call completes is committed and before any float is written: returned as the
    call's `_Held` (else None). A call bringing INT8-wire pairs is read back here: its pairs
    are written in place as they complete."""
    wire = st.wire
    weights = [validator.item(i, w) for i, w in enumerate(weights)]
    halves: dict = {}  # wire weight -> [int8, scale] once this call brings a half
    deferred = DeferredChecks()
    defers = getattr(quantizer, "defers_finite_check", False) and not any(
        wire.weight_of(n, t) is not None for n, t in weights)
    for i, (name, tensor) in enumerate(weights):
        validator.once(name, i, seen)
        once_per_sync(st, name)
        wired = wire.weight_of(name, tensor)
        if wired is None:
            # a deferring quantizer refuses NaN / Inf of its projections itself
            validator.check(name, tensor, quantizer, deferred=deferred,
                            values=not (defers and validator.target(name) is not None))
        else:
            wire.validate(name, wired, tensor, deferred=deferred)
            which = wire.half(name, wired)
            if which is not None:
                halves.setdefault(wired, wire.held(wired))[which] = tensor
    for wired, (q, scale) in halves.items():  # pairs this call completes
        if q is not None and scale is not None:
            wire.check_pair(wired, q, scale, deferred=deferred)
    if defers:  # read back with the quantizer's flags, before any write (`SyncLoad._settle`)
        return weights, _Held(deferred, holds=True, defers=True)
    deferred.raise_first()  # the call's one host synchronisation
    return weights, None


def once_per_sync(st, name: str, record: bool = False) -> None:
    """Refuse a name an earlier call of the sync `st` brought (two buckets with one tensor: the
    last copy would otherwise win without a word); `record`: note `name` as this call's."""
    first = st.names.get(name)
    if first is not None and first != st.calls:
        raise WeightSyncError(
            f"{name}: arrived twice in one weight sync (load_weights calls {first + 1} and "
            f"{st.calls + 1} of this sync, e.g. two buckets); a sync sends each tensor once")
    if record:
        st.names[name] = st.calls


def quantize(target, quantizer, name: str, tensor: torch.Tensor):
    """`tensor`'s payload by its target's scheme; the quantizer's refusals name it."""
    try:
        return target.scheme.quantize(quantizer, name, tensor)
    except WeightSyncError:
        raise
    except ValueError as exc:
        raise WeightSyncError(f"{name}: {exc}; refusing the sync") from None


def fail_call(st, consistency, exc: BaseException) -> None:
    """A load call raised: this sync's staged (uncommitted) layers are dropped and keep their
    previous weights; anything already written makes the model inconsistent."""
    st.staged.drop()
    st.wire.drop()
    st.names.clear()  # what was staged is dropped: a retry of this sync sends it again
    if st.failure is None:
        st.failure = failure_reason(exc)
    if st.wrote:
        consistency.mark(failure_reason(exc))


class _Held:
    """A call's deferred checks (`SyncLoad._settle`), and what a list call (`holds`) holds back
    until they are read back. `defers`: the quantizer hands its NaN / Inf refusal back as a
    device flag (`defers_finite_check`)."""

    def __init__(self, checks: DeferredChecks, holds: bool, defers: bool):
        self.checks, self.holds, self.defers = checks, holds, defers
        self.commits: list = []  # a list call's completed layers, committed after the checks

    def settle(self, st) -> None:
        """The deferred checks read back (one host synchronisation), then the completed layers
        committed; nothing of the call was written before."""
        self.checks.raise_first()
        for done in self.commits:
            st.wrote = True
            st.layers.add(done.target.path)
            done.commit()
        self.commits.clear()


def _refuse_quantized(quantizer, name: str) -> None:
    raise WeightSyncError(f"{name}: contains NaN or Inf (the {getattr(quantizer, 'name', 'online')} "
                          "quantizer's check, read back with the call's others); refusing the sync")
