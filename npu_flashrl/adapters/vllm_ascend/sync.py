"""The state of a weight sync and of the model across syncs.

A sync (`WeightSync`, `reload.py`: one lifecycle, as vLLM's `model_loader/reload/` has one:
begin / load / end) begins with the first `load_weights` after the previous sync ended, takes any
number of calls in any split and order, and ends once (`end_weight_sync`). What it holds meanwhile
is one `SyncState`; the model's consistency across syncs (weights of two syncs => refuse to
generate until a complete sync) is `Consistency`, the one place that marks, refuses and lifts.

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

import dataclasses
from typing import Dict, List, Optional, Set

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


def short_list(items: List[str], n: int = 8) -> str:
    return f"{items[:n]}{' ...' if len(items) > n else ''}"


def failure_reason(exc: BaseException) -> str:
    """What a sync's failure is called: a refusal's own message; an interruption by its type."""
    text = str(exc)
    if isinstance(exc, Exception):
        return text or type(exc).__name__
    return f"interrupted by {type(exc).__name__}{': ' + text if text else ''}"


@dataclasses.dataclass
class SyncState:
    """What one weight sync holds, from the first `load_weights` call after the previous sync
    ended to its end (`WeightSync.end_sync`); a new one per sync."""
    wire: WireReceiver                  # INT8-wire pairs not yet complete (wire.py)
    staged: StagingArea = dataclasses.field(default_factory=StagingArea)
    failure: Optional[str] = None       # the first error of this sync
    wrote: bool = False                 # something of this sync reached the live weights
    layers: Set[str] = dataclasses.field(default_factory=set)   # quantized layers committed
    floats: Set[str] = dataclasses.field(default_factory=set)   # float parameters written (resolved)
    items: int = 0                      # (name, tensor) items pushed
    calls: int = 0                      # load calls of this sync
    copied_bytes: int = 0               # streamed float tensors copied to wait for their flush
    names: Dict[str, int] = dataclasses.field(default_factory=dict)  # name -> the call that brought it
