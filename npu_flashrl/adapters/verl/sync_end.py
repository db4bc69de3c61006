"""The rule both verl modes share for a weight sync into an INT8 rollout model: once upstream's
update of the base weights returns, end the sync of every model npu_flashrl's loader serves
(`end_weight_sync`: a fused layer still missing shards fails the sync, naming them; its previous
weights stay). A LoRA adapter sync (verl clones the tensors into `add_lora`; `load_weights` never
runs) is upstream's alone. When upstream's update fails, each model's staged shards are dropped
and upstream's error is the one raised: nothing of a failed sync is committed by a later one.

Used by :mod:`.sync_mode` (sync-mode verl: ``vLLMRollout.update_weights``, async) and
:mod:`.server_mode` (server-mode verl: ``update_weights_from_ipc`` in verl's vLLM workers).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Iterable, List, Mapping, TypeVar

from npu_flashrl import lines

LOADER_ATTR = lines.SYNC_ATTR  # set by the attach: the model's weight sync

T = TypeVar("T")


def lora_adapter_sync(kwargs: Mapping[str, Any]) -> bool:
    """verl's LoRA path (``peft_config`` and ``base_sync_done``) adds an adapter: the base
    weights, and npu_flashrl's loader, are untouched."""
    return bool(kwargs.get("peft_config", None) and kwargs.get("base_sync_done", False))


def int8_models(models: Iterable[Any]) -> List[Any]:
    """The models a sync must end: those with npu_flashrl's INT8 loader (any other model is
    vLLM's own, nothing is staged)."""
    return [m for m in models if getattr(m, LOADER_ATTR, None) is not None]


def end_syncs(models: List[Any], failed: bool) -> None:
    """End the sync of every model; after a failed update the staged shards are dropped and
    their errors are not raised (the update's error is the one to see)."""
    from npu_flashrl.adapters import vllm_ascend

    errors = []
    for model in models:
        try:
            vllm_ascend.end_weight_sync(model)
        except vllm_ascend.WeightSyncError as exc:
            errors.append(exc)
    if errors and not failed:
        raise errors[0]


def run_and_end(update: Callable[[], T], models: List[Any]) -> T:
    """`update()`, then every model's sync ended (see the module doc)."""
    try:
        result = update()
    except BaseException:
        end_syncs(models, failed=True)
        raise
    end_syncs(models, failed=False)
    return result


async def arun_and_end(update: Callable[[], Awaitable[T]], models: List[Any]) -> T:
    """`await update()`, then every model's sync ended (see the module doc)."""
    try:
        result = await update()
    except BaseException:
        end_syncs(models, failed=True)
        raise
    end_syncs(models, failed=False)
    return result
