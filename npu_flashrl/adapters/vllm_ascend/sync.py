"""A weight sync as an object with a lifecycle, as vLLM's `model_loader/reload/` has one
(initialize / load / finalize): `WeightSync` begins with the first `load_weights` after the
previous sync ended, takes any number of `load(weights)` calls in any split and order, and
`end()`s once. The model's consistency across syncs (weights of two syncs => refuse to generate
until a complete sync) is `Consistency`, the one place that marks, refuses and lifts.

Completeness is the rule: the end of a sync names every quantized layer and float parameter that
did not arrive since the last complete sync, and refuses it; layers that did arrive hold new
weights and the others old ones, so the model refuses to generate until a complete sync. A
partial sync that is meant (a subset on purpose) is declared, `end(partial=True)`: it ends clean
and what it wrote counts toward the next complete sync. An empty sync is refused (declared
partial: warned about). Any exit from a load (an error, KeyboardInterrupt, asyncio
cancellation) after something of the sync was written leaves the model refusing to generate,
and the exception propagates unchanged.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend.staging import StagingArea
from npu_flashrl.adapters.vllm_ascend.wire import WireReceiver
from npu_flashrl.quant import WeightSyncError

logger = get_logger(__name__)


class Consistency:
    """Whether the model holds weights of one sync. While it does not (`reason` set), the model's
    forward and every quantized layer's forward raise: hooks exist only then, so a healthy model
    pays nothing."""

    def __init__(self, model: torch.nn.Module, layers):
        self._modules = [model] + [t.layer for t in layers]
        self.reason: Optional[str] = None
        self._hooks: list = []
        # written by syncs that ended clean since the model last held one complete set of
        # weights (declared partial syncs); what a sync adds to these must complete them
        self.layers: Set[str] = set()
        self.floats: Set[str] = set()

    def mark(self, reason: str) -> None:
        # a complete sync from here on must bring everything again
        self.layers, self.floats = set(), set()
        if self.reason is None:
            self.reason = reason
            logger.error("npu_flashrl: weight sync failed part-way (%s); the model refuses to "
                         "generate until a complete sync succeeds", reason)
            self._hooks = [m.register_forward_pre_hook(self._refuse) for m in self._modules]

    def clear(self) -> None:
        self.layers, self.floats = set(), set()
        self.reason = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _refuse(self, module, args):
        raise WeightSyncError(f"the model holds weights of two syncs after a failed weight sync "
                              f"({self.reason}); run a complete sync before generating")


def _names(items: List[str], n: int = 8) -> str:
    return f"{items[:n]}{' ...' if len(items) > n else ''}"


def _reason(exc: BaseException) -> str:
    """What a sync's failure is called: a refusal's own message; an interruption by its type."""
    text = str(exc)
    if isinstance(exc, Exception):
        return text or type(exc).__name__
    return f"interrupted by {type(exc).__name__}{': ' + text if text else ''}"


class WeightSync:
    """One sync into a processed INT8 model (`loader`: its `Int8WeightLoader`).

    What a failed sync leaves: a list/dict call is checked whole (form, names, shapes, dtypes,
    NaN/Inf in the rollout dtype, profile entries) before anything of it is written. A streamed
    call (generator) is checked item by item; if it fails after something of the sync was
    written, the model holds weights of two syncs: it is marked inconsistent, `end` raises
    saying so, and the model's forward raises until a complete sync (every parameter, no
    failure) ends cleanly.
    """

    def __init__(self, loader):
        self.loader = loader
        self.staged = StagingArea()
        self.wire = WireReceiver(loader)    # INT8-wire pairs not yet complete (wire.py)
        self.failure: Optional[str] = None  # the first error of this sync
        self.wrote = False                  # something of this sync reached the live weights
        self.layers: Set[str] = set()       # quantized layers committed
        self.floats: Set[str] = set()       # float parameters written (resolved names)
        self.items = 0                      # (name, tensor) items pushed
        self.calls = 0                      # load calls of this sync
        self.names: dict = {}               # name -> the load call (0-based) that brought it

    # ------------------------------------------------------------------ load
    def load(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        loader = self.loader
        validator = loader.validator
        if isinstance(weights, dict):
            weights = list(weights.items())
        checked = isinstance(weights, (list, tuple))
        loaded: Set[str] = set()
        buffer: List[Tuple[str, torch.Tensor]] = []
        buffered = 0
        limit = loader.passthrough_buffer_bytes
        seen: dict = {}
        try:
            if checked:
                # refuse a bad call before writing anything of it
                weights = [validator.item(i, w) for i, w in enumerate(weights)]
                halves: dict = {}  # wire weight -> [int8, scale] once this call brings a half
                for i, (name, tensor) in enumerate(weights):
                    validator.once(name, i, seen)
                    self._once_per_sync(name)
                    wired = self.wire.weight_of(name, tensor)
                    if wired is None:
                        validator.check(name, tensor, loader.quantizer)
                    else:
                        self.wire.validate(name, wired, tensor)
                        if name == wired or name.endswith(".weight_scale"):
                            half = halves.setdefault(wired, self.wire.held(wired))
                            half[0 if name == wired else 1] = tensor
                for wired, (q, scale) in halves.items():  # pairs this call completes
                    if q is not None and scale is not None:
                        self.wire.check_pair(wired, q, scale)
            for i, item in enumerate(weights):
                name, tensor = item if checked else validator.item(i, item)
                self.items += 1
                if not checked:
                    validator.once(name, i, seen)
                self._once_per_sync(name, record=True)
                wired = self.wire.weight_of(name, tensor)
                if wired is not None:  # INT8 wire: pre-quantized on the trainer (wire.py)
                    if not checked:
                        self.wire.validate(name, wired, tensor)
                    loaded |= self._take_wire(name, wired, tensor, borrowed=checked)
                    continue
                target = validator.target(name)
                if not checked:
                    # streamed: the quantizer finds NaN/Inf in projections during its own pass
                    validator.check(name, tensor, loader.quantizer, values=target is None)
                if target is not None:
                    if self._stage(target, name, tensor):
                        loaded.add(name)
                    continue
                size = tensor.numel() * tensor.element_size()
                if buffer and buffered + size > limit:
                    loaded |= self._flush(buffer)
                    buffered = 0
                buffer.append((name, loader.quantizer.transform(name, tensor)))
                buffered += size
                del tensor, item  # the buffer holds the only reference we keep
                if buffered >= limit:
                    loaded |= self._flush(buffer)
                    buffered = 0
            if buffer:
                loaded |= self._flush(buffer)
            self.wire.keep()
        except BaseException as exc:  # KeyboardInterrupt / CancelledError too: re-raised as is
            self.fail(exc)
            raise
        finally:
            self.calls += 1
        return loaded

    def _once_per_sync(self, name: str, record: bool = False) -> None:
        """Refuse a name an earlier call of this sync brought (two buckets with one tensor: the
        last copy would otherwise win without a word)."""
        first = self.names.get(name)
        if first is not None and first != self.calls:
            raise WeightSyncError(
                f"{name}: arrived twice in one weight sync (load_weights calls {first + 1} and "
                f"{self.calls + 1} of this sync, e.g. two buckets); a sync sends each tensor once")
        if record:
            self.names[name] = self.calls

    def _stage(self, target, name: str, tensor: torch.Tensor) -> bool:
        """Quantize and stage one shard; commit its layer once every shard this rank holds
        arrived. False for an expert this rank does not hold (checked, then dropped)."""
        if not target.holds(name):
            return False
        q, scale = self.loader.quantize(name, tensor)
        return self.stage_quantized(target, name, q, scale)

    def stage_quantized(self, target, name: str, q: torch.Tensor,
                        scale: Optional[torch.Tensor]) -> bool:
        """Stage one shard already quantized (int8 [out, in], fp32 scale [out] or None: keep the
        scales), the float path's quantizer output or the INT8 wire's pair; commit its layer once
        every shard this rank holds arrived. False for an expert this rank does not hold."""
        if not target.holds(name):
            return False
        if scale is None and target.scheme.needs_scales:
            # the profile quantizer keeps scales: refused at attach for MoE
            raise WeightSyncError(f"{name}: {self.loader.quantizer.name} gives no expert scales")
        done = self.staged.stage(target, name, q, scale)
        if done is not None:
            self.wrote = True
            self.layers.add(target.path)
            done.commit()
        return True

    def _take_wire(self, name: str, weight_name: str, tensor: torch.Tensor,
                   borrowed: bool) -> Set[str]:
        """One INT8-wire tensor: its projection is staged once its int8 and scale both arrived."""
        loaded, pair = self.wire.take(name, weight_name, tensor, borrowed)
        if pair is not None:
            target = self.loader.validator.target(weight_name)
            if not self.stage_quantized(target, weight_name, *pair):
                return set()  # an expert another rank holds: checked, then dropped
        return loaded

    def _flush(self, buffer: List[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Write buffered non-projection tensors through vLLM's loaders and empty the buffer."""
        names = [n for n, _ in buffer]
        self.wrote = True
        try:
            loaded = self.loader._original(iter(buffer))
        except AssertionError as exc:  # validated above; a loader's own rule we could not see
            raise WeightSyncError(f"{names[0] if len(names) == 1 else names}: does not fit the "
                                  f"rollout model ({str(exc) or 'a vLLM weight loader assertion'})") from None
        finally:
            buffer.clear()
        self.floats.update(r for r in map(self.loader.validator.resolve, names) if r)
        self._refresh_static_biases(names)
        return set(loaded) if loaded is not None else set(names)

    def _refresh_static_biases(self, names) -> None:
        """What a layer's scheme derives from its float bias (static W8A8: quant_bias)."""
        for name in names:
            if name.endswith(".bias"):
                target = self.loader.targets.get(name[: -len("bias")] + "weight")
                if target is not None:
                    target.scheme.after_bias_update(target.layer)

    def fail(self, exc: BaseException) -> None:
        """A load of this sync raised: its staged (uncommitted) layers are dropped and keep their
        previous weights; anything already written makes the model inconsistent."""
        self.staged.drop()
        self.wire.drop()
        self.names.clear()  # what was staged is dropped: a retry of this sync sends it again
        if self.failure is None:
            self.failure = _reason(exc)
        if self.wrote:
            self.loader.consistency.mark(_reason(exc))

    # ------------------------------------------------------------------ end
    def not_arrived(self) -> List[str]:
        """Every quantized layer and float parameter that no sync wrote since the model last held
        one complete set of weights (this one included), as HF names where they have one."""
        loader, c = self.loader, self.loader.consistency
        layers = loader.required_layers - c.layers - self.layers
        floats = loader.required_floats - c.floats - self.floats
        return list(dict.fromkeys(loader.names_of(layers, floats)))

    def end(self, partial: bool = False) -> List[str]:
        """End this sync: [] when it is complete (or declared `partial` and clean); otherwise a
        WeightSyncError naming what failed or never arrived, saying whether the model holds
        weights of two syncs (then it refuses to generate until a complete sync)."""
        consistency = self.loader.consistency
        # a wire half missing is also its layer's missing shard: each name once
        missing = list(dict.fromkeys(self.staged.missing() + self.wire.missing()))
        self.staged.drop()
        self.wire.drop()
        failure, empty = self.failure, self.items == 0 and self.failure is None
        if failure is None and missing:
            failure = (f"{len(missing)} shard(s) {'never arrived' if self.wrote else 'missing'}: "
                       f"{_names(missing)}")
        elif failure is None and empty:
            if partial:
                logger.warning("npu_flashrl: a partial weight sync ended with nothing arrived "
                               "(no load_weights call, or only empty ones); the model keeps its "
                               "previous weights")
                return []
            failure = ("nothing arrived (no load_weights call, or only empty ones) since the "
                       "last end of a sync")
        elif failure is None and not partial:
            gone = self.not_arrived()
            if gone:
                failure = (f"{len(gone)} tensor(s) never arrived since the last complete sync: "
                           f"{_names(gone, 16)} (a partial sync on purpose is declared: "
                           "end_weight_sync(model, partial=True))")
        if failure is not None:
            if self.wrote:  # what arrived holds new weights, the rest old ones
                consistency.mark(failure)
            tail = ("the model holds weights of two syncs and refuses to generate until a "
                    "complete sync succeeds" if consistency.reason is not None
                    else "nothing of it was written; the model keeps its previous weights")
            raise WeightSyncError(f"weight sync failed: {failure}; {tail}")
        consistency.layers |= self.layers
        consistency.floats |= self.floats
        if not self.not_arrived():
            if consistency.reason is not None:
                logger.info("npu_flashrl: a complete weight sync replaced the mixed weights; the "
                            "model generates again")
            consistency.clear()
        return []
