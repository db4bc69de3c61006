"""vLLM engine adapter: apply the FlashRL config where vLLM builds its engine config.

FlashRL 1.0.3 patches `vllm.LLM.__init__`; verl's async rollout never calls it, so FlashRL
silently does nothing there. We patch `EngineArgs.create_engine_config` instead, which every
engine (LLM, AsyncLLM, each external_launcher worker) goes through, and refuse the engines
FlashRL-style per-rank weight syncs do not reach instead of running them unquantized.
"""
from __future__ import annotations

import os

from npu_flashrl import config as flashrl_config
from npu_flashrl import patches
from npu_flashrl._logging import get_logger

logger = get_logger("vllm_engine")

TARGET = "vllm.engine.arg_utils:EngineArgs.create_engine_config"
PATCH_NAME = "vllm_engine_flashrl_config"
SYNC_FIX = "actor_rollout_ref.rollout.mode=sync"

_state = {"config": None, "entry": None}


def set_config(cfg) -> None:
    _state["config"] = cfg


def current_entry():
    return _state["entry"]


def _refuse_dummy_int8(engine_args, entry) -> None:
    """fn int8 keeps the W8A8 checkpoint's weight_scale through every sync (the profile's scales
    are relative to them): dummy weights would leave random scales in use for the whole run."""
    fmt = getattr(engine_args, "load_format", None)
    fmt = str(getattr(fmt, "value", fmt) or "").lower()
    if not flashrl_config.needs_profile(entry) or fmt != "dummy":
        return
    where = ("the config entry sets load_format: dummy" if entry.load_format
             else "the config entry has no load_format, so the engine's own (verl's default: dummy) is used")
    raise flashrl_config.ConfigError(
        f"npu_flashrl: FLASHRL_CONFIG={os.environ.get('FLASHRL_CONFIG')!r}: fn int8 with "
        f"load_format=dummy ({where}): the W8A8 model would be built with random weight_scale "
        "tensors that no weight sync replaces (the int8 profile keeps the checkpoint's scales), so "
        "every rollout would be garbage. Fix: set `load_format: auto` in that entry "
        f"(npu-flashrl setup --fn int8 -m W8A8 ... writes it), model {engine_args.model}")


def apply_entry(engine_args, cfg) -> "flashrl_config.RolloutConfig":
    """Pick this DP group's entry and rewrite the engine args the way FlashRL's config says."""
    from npu_flashrl.adapters import vllm_ascend

    tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(engine_args, "pipeline_parallel_size", 1) or 1)
    dp_rank = flashrl_config.dp_rank_from_env(tp, pp) if len(cfg.entries) > 1 else 0
    entry = flashrl_config.select_entry(cfg, dp_rank)
    backend = getattr(engine_args, "distributed_executor_backend", None)
    # FlashRL-style syncs reach the model only in external_launcher (SPMD) engines; an entry
    # without the key still needs one, or the INT8 path would be bypassed silently.
    required = entry.distributed_executor_backend or flashrl_config.EXTERNAL_LAUNCHER
    if backend != required:
        raise RuntimeError(
            f"npu_flashrl: FLASHRL_CONFIG={os.environ.get('FLASHRL_CONFIG')!r} is set but this vLLM "
            f"engine uses distributed_executor_backend={backend!r}, not "
            f"{required!r}: its weight syncs would bypass the INT8 reload "
            f"and the rollout would silently run in bf16. With verl set {SYNC_FIX} (verl's default "
            "async mode builds the engine this way); otherwise unset FLASHRL_CONFIG.")
    if entry.model:
        if getattr(engine_args, "tokenizer", None) in (None, engine_args.model):
            engine_args.tokenizer = engine_args.model
        engine_args.model = entry.model
    if entry.load_format:
        engine_args.load_format = entry.load_format
    _refuse_dummy_int8(engine_args, entry)
    profile = None
    if flashrl_config.is_quantized(entry):
        engine_args.quantization = "ascend"
        if flashrl_config.needs_profile(entry):
            from npu_flashrl.profile import load_profile

            profile = load_profile(entry.profile_path(engine_args.model))
        vllm_ascend.configure_online_quantization(entry.fn, profile)
    else:
        engine_args.quantization = entry.quantization
        vllm_ascend.configure_online_quantization(None)
    _state["entry"] = entry
    logger.info("npu_flashrl: DP group %d uses config entry fn=%s model=%s load_format=%s",
                dp_rank, entry.fn, engine_args.model, getattr(engine_args, "load_format", None))
    return entry


def _wrap(original):
    def create_engine_config(self, *args, **kwargs):
        cfg = _state["config"]
        if cfg is not None:
            apply_entry(self, cfg)
        return original(self, *args, **kwargs)
    return create_engine_config


@patches.register(PATCH_NAME, TARGET, "vllm 0.10.1, 0.11.0",
                  "FlashRL config applied per DP group to every vLLM engine; async engines refused")
def _apply() -> None:
    patches.replace(TARGET, _wrap)
