"""A weight sync as an object with a lifecycle, as vLLM's `model_loader/reload/` has one
(initialize / load / finalize): `WeightSync` begins with the first `load_weights` after the
previous sync ended, takes any number of `load(weights)` calls in any split and order, and
`end()`s once. The model's consistency across syncs (weights of two syncs => refuse to generate
until a complete sync) is `Consistency`, the one place that marks, refuses and lifts.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend.experts import ExpertTarget
from npu_flashrl.adapters.vllm_ascend.staging import StagingArea
from npu_flashrl.quant import WeightSyncError

logger = get_logger("vllm_ascend")


class Consistency:
    """Whether the model holds weights of one sync. While it does not (`reason` set), the model's
    forward and every quantized layer's forward raise: hooks exist only then, so a healthy model
    pays nothing."""

    def __init__(self, model: torch.nn.Module, layers):
        self._modules = [model] + [t.layer for t in layers]
        self.reason: Optional[str] = None
        self._hooks: list = []

    def mark(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            logger.error("npu_flashrl: weight sync failed part-way (%s); the model refuses to "
                         "generate until a complete sync succeeds", reason)
            self._hooks = [m.register_forward_pre_hook(self._refuse) for m in self._modules]

    def clear(self) -> None:
        self.reason = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _refuse(self, module, args):
        raise WeightSyncError(f"the model holds weights of two syncs after a failed weight sync "
                              f"({self.reason}); run a complete sync before generating")


def _names(items: List[str]) -> str:
    return f"{items[:8]}{' ...' if len(items) > 8 else ''}"


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
        self.failure: Optional[str] = None  # the first error of this sync
        self.wrote = False                  # something of this sync reached the live weights
        self.layers: Set[str] = set()       # quantized layers committed
        self.floats: Set[str] = set()       # float parameters written (resolved names)

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
        try:
            if checked:
                # refuse a bad call before writing anything of it
                weights = [validator.item(i, w) for i, w in enumerate(weights)]
                for name, tensor in weights:
                    validator.check(name, tensor, loader.quantizer)
            for i, item in enumerate(weights):
                name, tensor = item if checked else validator.item(i, item)
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
        except Exception as exc:
            self.fail(exc)
            raise
        return loaded

    def _stage(self, target, name: str, tensor: torch.Tensor) -> bool:
        """Quantize and stage one shard; commit its layer once every shard this rank holds
        arrived. False for an expert this rank does not hold (checked, then dropped)."""
        if not target.holds(name):
            return False
        q, scale = self.loader.quantize(name, tensor)
        if scale is None and isinstance(target, ExpertTarget):
            # the profile quantizer keeps scales: refused at attach for MoE
            raise WeightSyncError(f"{name}: {self.loader.quantizer.name} gives no expert scales")
        done = self.staged.stage(target, name, q, scale)
        if done is not None:
            self.wrote = True
            self.layers.add(target.path)
            done.commit()
        return True

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
        """A static W8A8 layer computes with quant_bias, not bias: re-fold after a bias update."""
        for name in names:
            if name.endswith(".bias"):
                target = self.loader.targets.get(name[: -len("bias")] + "weight")
                if target is not None and target.static:
                    _layout.current().refresh_static(target.layer)

    def fail(self, exc: BaseException) -> None:
        """A load of this sync raised: its staged (uncommitted) layers are dropped and keep their
        previous weights; anything already written makes the model inconsistent."""
        self.staged.drop()
        if self.failure is None:
            self.failure = str(exc)
        if self.wrote:
            self.loader.consistency.mark(str(exc))

    # ------------------------------------------------------------------ end
    def complete(self) -> bool:
        """Every quantized layer and every float parameter was written, nothing failed."""
        return (self.failure is None and not self.staged.missing()
                and self.loader.required_layers <= self.layers
                and self.loader.required_floats <= self.floats)

    def end(self) -> List[str]:
        """End this sync. Raises WeightSyncError when it failed part-way or when shards never
        arrived (those layers keep their previous weights); returns [] otherwise."""
        consistency = self.loader.consistency
        missing = self.staged.missing()
        complete = self.complete()
        self.staged.drop()
        failure = self.failure
        if missing and self.wrote:
            failure = f"{len(missing)} shard(s) never arrived: {_names(missing)}"
            consistency.mark(failure)
        if complete and consistency.reason is not None:
            logger.info("npu_flashrl: a complete weight sync replaced the mixed weights; the "
                        "model generates again")
            consistency.clear()
        if failure is not None or missing:
            if failure is None:
                failure = f"{len(missing)} shard(s) missing: {_names(missing)}"
            tail = ("the model holds weights of two syncs and refuses to generate until a "
                    "complete sync succeeds" if consistency.reason is not None
                    else "nothing of it was written; the model keeps its previous weights")
            raise WeightSyncError(f"weight sync failed: {failure}; {tail}")
        return missing
