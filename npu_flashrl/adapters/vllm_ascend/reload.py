"""In-place, bucket-safe weight sync for vllm-ascend's quantized linear and fused-MoE layers.

`WeightSync` replaces `model.load_weights` and is the one lifecycle of a weight sync, as vLLM's
`model_loader/reload/` has one: begin / load / end, the sync's state in one dataclass
(`sync.SyncState`). Before `process_weights_after_loading` a call is the cold load
(`cold_load.ColdLoad`: the stream becomes what the schemes' checkpoints carry, for vLLM's own
loaders). After it, every call belongs to a weight sync, begun by the first call after the
previous sync ended (`begin_sync`), loaded call by call (`sync_load.SyncLoad`: check, quantize,
stage, commit each layer IN PLACE once all its shards arrived: no new parameter storage, no
second post-processing, data pointers unchanged) and ended once (`end_sync`,
`completeness.Completeness`: complete, declared partial, or refused by name). The model's
quantized layers, every layer type in one map, are `targets.Targets`; each layer's scheme
(`schemes/`) owns its tensors; the quantizers are `npu_flashrl.quant`.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl import lines
from npu_flashrl.marks import marked
from npu_flashrl.adapters.vllm_ascend.names import to_model_names
from npu_flashrl.adapters.vllm_ascend.cold_load import ColdLoad
from npu_flashrl.adapters.vllm_ascend.completeness import Completeness
from npu_flashrl.adapters.vllm_ascend.schemes import LinearTarget  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.linear import find_linear_targets as find_targets  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.sync import Consistency, SyncState
from npu_flashrl.adapters.vllm_ascend.sync_load import SyncLoad
from npu_flashrl.adapters.vllm_ascend.targets import Targets, check_quantizer
from npu_flashrl.adapters.vllm_ascend.validate import Validator
from npu_flashrl.adapters.vllm_ascend.wire import WireReceiver
from npu_flashrl.quant import OnlineQuantizer, WeightSyncError

logger = get_logger(__name__)

SYNC_ATTR = lines.SYNC_ATTR  # set on the rollout model by `attach`: its weight sync


class WeightSync:
    """The quantized rollout model's `load_weights`: its cold load and its weight syncs.

    One instance per vLLM model. A *sync* is everything between two `end_sync()` calls; it may
    arrive as any number of `load_weights` calls in any split and order. What a failed sync
    leaves: a list/dict call is checked whole before anything of it is written; a streamed call
    item by item, and if it fails after something of the sync was written the model holds
    weights of two syncs: it is marked inconsistent, the end of the sync raises saying so, and
    the model's forward raises until a complete sync ends cleanly.
    """

    # Non-projection tensors of a streamed sync are written in small groups: at most this many
    # bytes are held (or one tensor, when it alone is larger), never the whole stream.
    passthrough_buffer_bytes = 64 << 20

    def __init__(self, model: torch.nn.Module, quantizer: OnlineQuantizer, original_load_weights,
                 prequantized_checkpoint: bool = False):
        self.model = model
        self.quantizer = quantizer
        self._original = original_load_weights
        self.layers = Targets(model)  # every quantized layer, whatever its layer type
        self.validator = Validator(model, self.layers.linear(), self.layers.moe())
        self.cold = ColdLoad(self.layers, self.validator, prequantized_checkpoint)
        self.completeness = Completeness(self.layers, self.validator.params,
                                         Consistency(model, self.layers.layers.values()))
        self.state: Optional[SyncState] = None  # the sync in progress (None: none begun)
        self.check_quantizer()

    @property
    def targets(self) -> Dict[str, object]:
        """HF projection name -> its quantized linear layer's target."""
        return self.layers.linear()

    @property
    def experts(self) -> Dict[str, object]:
        """HF expert name -> its fused-MoE layer's target."""
        return self.layers.moe()

    @property
    def consistency(self) -> Consistency:
        return self.completeness.consistency

    @property
    def inconsistent(self) -> Optional[str]:
        """Why the model holds weights of two syncs (None: it does not)."""
        return self.consistency.reason

    def processed(self) -> bool:
        is_processed = lines.current().is_processed
        layers = self.layers.modules()
        return bool(layers) and all(is_processed(l) for l in layers)

    def check_quantizer(self) -> None:
        check_quantizer(self.quantizer, self.layers, self.validator.params, self.model)

    # ------------------------------------------------------------------ lifecycle
    def begin_sync(self) -> SyncState:
        """The state of the sync in progress, begun now if none is."""
        if self.state is None:
            self.state = SyncState(wire=WireReceiver(self.validator.target, self.quantizer))
        return self.state

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        weights = to_model_names(self.model, weights)  # a VL model's hf_to_vllm_mapper (names.py)
        # Until vLLM's layerwise reload is finalized every tensor is its (the float ones arriving
        # after the last quantized layer was processed again too): none of it begins a sync.
        layerwise = lines.current().layerwise_reload_active(self.model)
        if layerwise or not self.processed():
            # A layer that was processed before and is not now was put back into its checkpoint
            # layout by vLLM's layerwise reload, which holds the tensors it is given until the
            # layer is complete, possibly past this call: give it copies, not the caller's
            # (bucket) tensors. A cold load from disk needs no copy.
            reloading = layerwise or any(marked(m, lines.PROCESSED_ATTR)
                                         for m in self.layers.modules())
            return self._original(self.cold.stream(weights, self.quantizer, copy=reloading))
        state = self.begin_sync()
        return SyncLoad(state, self.validator, self.layers, self.quantizer, self.consistency,
                        self._original, self.passthrough_buffer_bytes).run(weights)

    def end_sync(self, partial: bool = False) -> List[str]:
        """End the current sync: [] when everything arrived since the last complete sync (or the
        sync is declared `partial` and clean); otherwise a WeightSyncError naming what failed or
        never arrived (`Completeness.end`)."""
        state = self.begin_sync()
        try:
            return self.completeness.end(state, partial)
        finally:
            self.state = None

    # ------------------------------------------------------------------ reporting
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


Int8WeightLoader = WeightSync  # its former name (it serves static W8A8 and the INT8 wire too)


def attach(model: torch.nn.Module, quantizer: OnlineQuantizer,
           prequantized_checkpoint: bool = False) -> WeightSync:
    """Give `model` the quantizing `load_weights` (idempotent; returns its `WeightSync`).
    `prequantized_checkpoint`: the model is cold-loaded from a W8A8 checkpoint."""
    from npu_flashrl.architectures import refuse_on_line

    refuse_on_line(type(model).__name__, "INT8 rollout engine build")  # before anything is attached
    existing = getattr(model, SYNC_ATTR, None)
    if existing is not None:
        previous, existing.quantizer = existing.quantizer, quantizer
        try:
            existing.check_quantizer()
        except WeightSyncError:
            existing.quantizer = previous
            raise
        return existing
    sync = WeightSync(model, quantizer, model.load_weights, prequantized_checkpoint)
    setattr(model, SYNC_ATTR, sync)
    model.load_weights = sync.load_weights
    logger.debug("npu_flashrl: weight sync attached to %s (%d quantized projections, %s)",
                 type(model).__name__, len(sync.targets), quantizer.name)
    from npu_flashrl.architectures import warn_if_not_covered

    warn_if_not_covered(type(model).__name__, "INT8 rollout engine build")
    return sync


def end_weight_sync(model: torch.nn.Module, partial: bool = False) -> List[str]:
    """End the model's current weight sync (`WeightSync.end_sync`). `partial=True` declares a
    sync that sends a subset on purpose: it is not refused for what it left out, and what it
    wrote counts toward the next complete sync."""
    sync = getattr(model, SYNC_ATTR, None)
    if sync is None:
        raise RuntimeError("this model has no npu_flashrl INT8 loader (was npu_flashrl active when "
                           "the rollout engine was built?)")
    return sync.end_sync(partial=partial)
