"""verl's checkpoint engines (server-mode line) (one-step-off, fully-async): start-up refusals and the INT8 wire.

With `rollout.checkpoint_engine.backend` other than `naive`, verl's `CheckpointEngineManager`
(`verl/checkpoint_engine/base.py`) aborts the in-flight requests, broadcasts the trainer's
weights to a `CheckpointEngineWorker` per rollout rank, and each of them hands them to
`ServerAdapter.update_weights`, i.e. through verl's bucketed transfer into the same
`update_weights_from_ipc` that `server_mode` wraps. So every sync is ended and checked as in
colocated mode; what is specific to checkpoint engines is here:

- patch `verl_checkpoint_engine_refusals` (on `CheckpointEngineRegistry.get`, which the trainer
  worker's `init_model`, every rollout-side `CheckpointEngineWorker` and the manager call before
  any weight moves): with an INT8 FLASHRL_CONFIG, `delta_sharded` is refused by name. Its patch
  loader writes bf16 values into the model's parameters, which in the INT8 rollout are int8.
- `check_config(select, cfg)`: the same refusal on the driver (`npu-flashrl verify`, the verl
  config check), plus `wire: int8` with a rollout other than vLLM.
- patch `verl_int8_wire` (on `ActorRolloutRefWorker.update_weights`, trainer side): with `wire:
  int8`, the stream the model engine exports (`get_per_tensor_param`, FSDP or Megatron) goes
  through `npu_flashrl.quant.wire.int8_wire` before it reaches the checkpoint engine (or, with
  `naive`, the colocated `ServerAdapter`): projections as int8 + fp32 scale, quantized by the
  rollout's kernel in the rollout's dtype (`rollout.dtype`). LoRA adapter syncs stay as they are.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.lines import verl as verl_lines

logger = get_logger(__name__)

_REGISTRY = "verl.checkpoint_engine.base:CheckpointEngineRegistry.get"
_WORKER = "verl.workers.engine_workers:ActorRolloutRefWorker.update_weights"
PATCH_REFUSALS = "verl_checkpoint_engine_refusals"
PATCH_WIRE = "verl_int8_wire"
PATCHES = (PATCH_REFUSALS, PATCH_WIRE)
VERSIONS = verl_lines.server_versions()

BACKEND_KEY = "actor_rollout_ref.rollout.checkpoint_engine.backend"
ROLLOUT_NAME_KEY = "actor_rollout_ref.rollout.name"
# backends whose receiver is not a full-tensor load into the rollout model, with the reason
REFUSED_BACKENDS = {
    "delta_sharded": (
        "its steady syncs are sparse bf16 patches that vLLM's delta consumer writes into the "
        "model's parameters, which in npu_flashrl's INT8 rollout are int8 (W8A8_DYNAMIC): the "
        "INT8 layers would be corrupted. Use checkpoint_engine.backend=nccl (HCCL on Ascend) or "
        "naive (colocated), or a bf16 rollout (FLASHRL_CONFIG fn: bf16)"),
}


class CheckpointEngineError(NpuFlashrlError, RuntimeError):
    """A checkpoint-engine setting that cannot work with the FlashRL config; says what to change."""


def _config():
    from npu_flashrl.adapters import vllm_engine

    cfg = vllm_engine.current_config()  # the config activated in this process
    if cfg is None and (os.environ.get("FLASHRL_CONFIG") or "").strip():
        from npu_flashrl.config import load_config

        cfg = load_config()
    return cfg


def config_from(environ) -> Optional[Any]:
    """The FlashRL config FLASHRL_CONFIG in `environ` names, or None when unset or unreadable
    (an unreadable one is reported by the config checks themselves)."""
    from npu_flashrl.config import ConfigError, load_config

    value = (environ.get("FLASHRL_CONFIG") or "").strip()
    if not value:
        return None
    try:
        return load_config(value)
    except ConfigError:
        return None


def _int8_entries(cfg) -> list:
    from npu_flashrl.config import is_quantized

    return [] if cfg is None else [e.fn for e in cfg.entries if is_quantized(e)]


def backend_problem(backend: Any, cfg) -> Optional[str]:
    """Why `backend` cannot carry syncs into this FlashRL config's rollout, or None."""
    name = str(backend or "").strip()
    fns = _int8_entries(cfg)
    if name in REFUSED_BACKENDS and fns:
        return (f"checkpoint_engine.backend={name} with an INT8 rollout (FLASHRL_CONFIG "
                f"{getattr(cfg, 'path', None) or os.environ.get('FLASHRL_CONFIG')!r}, fn {fns[0]}): "
                f"{REFUSED_BACKENDS[name]}")
    return None


def check_config(select: Callable[[str], Any], cfg) -> None:
    """Driver-side: refuse what cannot work before any Ray actor starts (`select(dotted_key)`
    reads the verl config, `cfg` is the FlashRL config or None)."""
    from npu_flashrl.config import wire_of

    if cfg is None:
        return
    problem = backend_problem(select(BACKEND_KEY), cfg)
    if problem:
        raise CheckpointEngineError(f"npu_flashrl: {problem}")
    rollout = str(select(ROLLOUT_NAME_KEY) or "vllm").strip()
    if wire_of(cfg) == "int8" and rollout != "vllm":
        raise CheckpointEngineError(
            f"npu_flashrl: `wire: int8` with {ROLLOUT_NAME_KEY}={rollout}: the INT8 wire's receiver "
            "is npu_flashrl's loader in verl's vLLM rollout only. Use rollout.name=vllm or drop "
            "`wire: int8`")


# ----------------------------------------------------------------------------- start-up refusal

def _wrap_get(original):
    func = original.__func__ if hasattr(original, "__func__") else original

    @functools.wraps(func)
    def get(cls, backend: str):
        problem = backend_problem(backend, _config())
        if problem:
            raise CheckpointEngineError(f"npu_flashrl: {problem}")
        return func(cls, backend)

    # a bound classmethod forwards attribute reads to its function: mark it as the wrapper
    setattr(get, patches.ORIGINAL_ATTR, original)
    return classmethod(get)


@patches.register(PATCH_REFUSALS, _REGISTRY, VERSIONS,
                  "refuse checkpoint engines that cannot feed an INT8 rollout (delta_sharded) "
                  "where verl builds them (trainer worker, CheckpointEngineWorker, manager)")
def _apply_refusals() -> None:
    patches.replace(_REGISTRY, _wrap_get)


# ----------------------------------------------------------------------------- the INT8 wire

def wire_dtype(worker) -> Optional[Any]:
    """The compute dtype for the trainer-side quantization when this process sends the INT8
    wire (the rollout model's dtype, `rollout.dtype`), else None."""
    import torch

    from npu_flashrl.config import wire_of

    cfg = _config()
    if cfg is None or wire_of(cfg) != "int8":
        return None
    rollout = getattr(getattr(worker, "config", None), "rollout", None)
    name = str(getattr(rollout, "dtype", None) or "bfloat16").replace("torch.", "")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointEngineError(f"actor_rollout_ref.rollout.dtype={name!r}: not a torch "
                                    "floating-point dtype; the INT8 wire quantizes in it")
    return dtype


def wrap_engine_export(engine, dtype) -> Callable[[], None]:
    """Make `engine.get_per_tensor_param` (verl's model-engine export) yield the INT8 wire;
    returns the undo."""
    from npu_flashrl.quant.wire import int8_wire

    export = engine.get_per_tensor_param

    def get_per_tensor_param(*args, **kwargs):
        params, peft_config = export(*args, **kwargs)
        if peft_config is not None:  # LoRA adapter tensors: add_lora takes them as they are
            return params, peft_config
        return int8_wire(params, dtype), peft_config

    engine.get_per_tensor_param = get_per_tensor_param
    return lambda: engine.__dict__.pop("get_per_tensor_param", None)


def _wrap_update(original):
    @functools.wraps(original)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        dtype = wire_dtype(self)
        if dtype is None:
            return await original(self, global_steps=global_steps, mode=mode)
        undo = wrap_engine_export(self.actor.engine, dtype)
        try:
            return await original(self, global_steps=global_steps, mode=mode)
        finally:
            undo()

    return update_weights


@patches.register(PATCH_WIRE, _WORKER, VERSIONS,
                  "wire: int8: the trainer sends projections as int8 + scale (W8A8_DYNAMIC names)")
def _apply_wire() -> None:
    # verl's worker module is imported by trainer processes only: patch it when it is imported
    # there, never import it (and its dataset / FSDP dependencies) everywhere else
    patches.when_imported(_WORKER.split(":")[0], lambda _module: patches.replace(_WORKER, _wrap_update))


def install() -> dict:
    return patches.apply_patches(list(PATCHES))
