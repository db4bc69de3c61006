"""The end of a weight sync: is it complete, and what does its message say.

Completeness is the rule (`sync.py`): the end of a sync names every quantized layer and float
parameter that did not arrive since the model last held one complete set of weights, and refuses
it; a sync declared partial ends clean and counts toward the next complete one; an empty sync is
refused (declared partial: warned about). A refusal says whether the model now holds weights of
two syncs (then it refuses to generate until a complete sync: `Consistency`)."""
from __future__ import annotations

from typing import Dict, List, Set

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend.sync import Consistency, SyncState, short_list
from npu_flashrl.quant import WeightSyncError

logger = get_logger(__name__)


class Completeness:
    """What a complete sync of one model writes (`required_layers`, `required_floats`) and the
    model's consistency across syncs; `end(state)` ends one sync."""

    def __init__(self, targets, params: Dict[str, object], consistency: Consistency):
        self.targets = targets
        self.required_layers: Set[str] = set(targets.layers)
        self.required_floats: Set[str] = targets.required(params)
        self._order = {n: i for i, n in enumerate(params)}
        self.consistency = consistency

    def not_arrived(self, state: SyncState) -> List[str]:
        """Every quantized layer and float parameter that no sync wrote since the model last held
        one complete set of weights (this one included), as HF names where they have one."""
        c = self.consistency
        layers = self.required_layers - c.layers - state.layers
        floats = self.required_floats - c.floats - state.floats
        return list(dict.fromkeys(self.targets.names_of(layers, floats, self._order)))

    def end(self, state: SyncState, partial: bool = False) -> List[str]:
        """End the sync `state`: [] when it is complete (or declared `partial` and clean);
        otherwise a WeightSyncError naming what failed or never arrived."""
        consistency = self.consistency
        # a wire half missing is also its layer's missing shard: each name once
        half = state.wire.arrived_halves()
        missing = list(dict.fromkeys(state.staged.missing() + state.wire.missing()))
        state.staged.drop()
        state.wire.drop()
        failure, empty = state.failure, state.items == 0 and state.failure is None
        if failure is None and missing:
            failure = (f"{len(missing)} shard(s) {'never arrived' if state.wrote else 'missing'}: "
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
            gone = self.not_arrived(state)
            if gone:
                failure = (f"{len(gone)} tensor(s) never arrived since the last complete sync: "
                           f"{short_list(gone, 16)} (a partial sync on purpose is declared: "
                           "end_weight_sync(model, partial=True))")
        if failure is not None:
            if state.wrote:  # what arrived holds new weights, the rest old ones
                consistency.mark(failure)
            tail = ("the model holds weights of two syncs and refuses to generate until a "
                    "complete sync succeeds" if consistency.reason is not None
                    else "nothing of it was written; the model keeps its previous weights")
            raise WeightSyncError(f"weight sync failed: {failure}; {tail}")
        consistency.layers |= state.layers
        consistency.floats |= state.floats
        if not self.not_arrived(state):
            if consistency.reason is not None:
                logger.info("npu_flashrl: a complete weight sync replaced the mixed weights; the "
                            "model generates again")
            consistency.clear()
        return []
