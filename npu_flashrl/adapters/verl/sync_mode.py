"""verl sync mode (the sync-mode verl lines, `npu_flashrl.lines.verl`): every weight sync into the rollout ends with the
INT8 loader's check (the rule shared with server mode is :mod:`.sync_end`).

In sync (SPMD) mode the FSDP worker (``fsdp_workers.py`` ``rollout_mode``) and the Megatron worker
stream the trainer's full tensors into ``vLLMRollout.update_weights``
(``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py``), which calls
``model.load_weights(weights)`` on the vLLM model. Whether vLLM's
``process_weights_after_loading`` follows depends on the verl release (a line fact): the pinned
line's verl calls it (a no-op on already processed INT8 layers, see the vllm_ascend adapter); the
sync-mode verl of the middle line calls nothing after ``load_weights``, so whatever vllm-ascend
derives only when it post-processes stays at its cold-load values there: MLA's ``W_UK_T`` /
``W_UV`` (DeepSeek-V2 / V3), which that line therefore refuses for INT8 rollouts
(``StackLine.refused_architectures``, in ``npu_flashrl/lines/``). Nothing in verl says where
a sync ends, so a layer whose shard never arrived would stay staged and stale, unreported, and a
later sync could commit it with an earlier sync's shards. The wrapper below ends the sync once
verl's ``update_weights`` returns: ``end_weight_sync`` raises naming the missing tensors (their
layers keep their previous weights) and the next sync starts clean; when ``update_weights`` itself
fails, the staged shards are dropped and verl's error is raised.

Applied lazily (``patches.when_imported``): only rollout workers import verl's vLLM rollout module,
and importing it elsewhere would pull vLLM, Ray and ZeroMQ into the trainer.
"""
from __future__ import annotations

import functools

from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.verl import sync_end
from npu_flashrl.lines import verl as verl_lines

logger = get_logger(__name__)

ROLLOUT_MODULE = "verl.workers.rollout.vllm_rollout.vllm_rollout_spmd"
TARGET = f"{ROLLOUT_MODULE}:vLLMRollout.update_weights"
PATCH_SYNC_END = "verl_rollout_sync_end"


def rollout_model(rollout):
    """The vLLM model sync-mode verl's ``vLLMRollout.update_weights`` loads into (same attribute path)."""
    return rollout.inference_engine.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _wrap_update_weights(original):
    @functools.wraps(original)
    async def update_weights(self, weights, **kwargs):
        if sync_end.lora_adapter_sync(kwargs):
            return await original(self, weights, **kwargs)
        return await sync_end.arun_and_end(lambda: original(self, weights, **kwargs),
                                           sync_end.int8_models([rollout_model(self)]))

    return update_weights


def _patch_module(module) -> None:
    cls = getattr(module, "vLLMRollout", None)
    current = getattr(cls, "update_weights", None) if cls is not None else None
    if current is None:
        logger.warning("npu_flashrl: %s has no vLLMRollout.update_weights; weight syncs end unchecked "
                       "(a layer whose shard never arrives stays stale, unreported)", ROLLOUT_MODULE)
        return
    try:
        patches.replace(TARGET, _wrap_update_weights)
    except patches.PatchNotApplicable as exc:  # runs inside verl's import: never break it
        logger.warning("npu_flashrl: cannot patch %s -> %s: %s", PATCH_SYNC_END, TARGET, exc)


@patches.register(PATCH_SYNC_END, TARGET, verl_lines.sync_versions(),
                  doc="every verl weight sync into the vLLM rollout ends with end_weight_sync: a layer "
                      "whose shard never arrived fails the sync, naming it")
def _apply_sync_end() -> None:
    patches.when_imported(ROLLOUT_MODULE, _patch_module)
