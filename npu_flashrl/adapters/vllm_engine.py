"""vLLM engine adapter: apply the FlashRL config where vLLM builds its engine config.

FlashRL 1.0.3 patches `vllm.LLM.__init__`; verl's async rollout never calls it, so FlashRL
silently does nothing there. We patch `EngineArgs.create_engine_config` instead, which every
engine (LLM, AsyncLLM, each external_launcher worker) goes through, and refuse the engines
FlashRL-style per-rank weight syncs do not reach instead of running them unquantized.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Protocol

from npu_flashrl import config as flashrl_config
from npu_flashrl import lines
from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.engine_choice import (  # noqa: F401  (engine_choice, CHOICE_KEY: re-exported)
    CHOICE_KEY, EngineChoice, building, engine_choice, with_choice)
from npu_flashrl.errors import UnquantizedRolloutError

logger = get_logger(__name__)

TARGET = "vllm.engine.arg_utils:EngineArgs.create_engine_config"
PATCH_NAME = "vllm_engine_flashrl_config"
SYNC_FIX = "actor_rollout_ref.rollout.mode=sync"

# The FlashRL config this process applies to the engines it builds (loaded by `activation`).
# Process state by nature (one FLASHRL_CONFIG per process); what each engine got is only in that
# engine's config (`EngineChoice`).
_config: List[Optional["flashrl_config.FlashRLConfig"]] = [None]


def set_config(cfg: Optional["flashrl_config.FlashRLConfig"]) -> None:
    """The config the engine patch applies from now on (None: engines are left as built)."""
    _config[0] = cfg


def current_config() -> Optional["flashrl_config.FlashRLConfig"]:
    return _config[0]


# ------------------------------------------------------------------ server engines (registry)

class ServerEngines(Protocol):
    """What an RL framework whose rollout is a vLLM server tells the engine patch (registered by
    that framework's adapter, e.g. `adapters.verl.server_mode`; this module imports none)."""

    def is_server_engine(self, engine_args: Any) -> bool:
        """The engine is the framework's server engine (its syncs reach npu_flashrl's loader)."""

    def serves_the_policy(self) -> bool:
        """False where the framework serves a reward / teacher model with such an engine."""

    def replica_rank(self) -> int:
        """The replica whose entry a hybrid config gives this engine."""

    def check_engine_quantization(self, engine_args: Any) -> None:
        """Raise when the framework already asked this engine to quantize."""


_servers: List[ServerEngines] = []


def register_server_engines(rules: ServerEngines) -> None:
    """Make the engine patch recognise `rules`' server engines (idempotent per rules class)."""
    if not any(type(r) is type(rules) for r in _servers):
        _servers.append(rules)


def _server_rules(engine_args) -> Optional[ServerEngines]:
    return next((r for r in _servers if r.is_server_engine(engine_args)), None)


def _record_choice(engine_args, entry, rank: int) -> None:
    choice = EngineChoice(fn=entry.fn if flashrl_config.is_quantized(entry) else None,
                          profile=entry.profile_path(engine_args.model)
                          if flashrl_config.needs_profile(entry) else None,
                          rank=rank, group_size=entry.group_size)
    engine_args.additional_config = with_choice(getattr(engine_args, "additional_config", None), choice)


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


def _refuse_fp16_int8(dtype, entry) -> None:
    problem = flashrl_config.int8_rollout_dtype_problem(dtype)
    if problem:
        raise flashrl_config.ConfigError(f"npu_flashrl: FLASHRL_CONFIG entry fn={entry.fn}: {problem}")


def apply_entry(engine_args, cfg) -> Optional["flashrl_config.RolloutConfig"]:
    """Pick this DP group's entry and rewrite the engine args the way FlashRL's config says.
    None (engine untouched) for a verl reward/teacher model server."""
    server = _server_rules(engine_args)
    if server is not None and not server.serves_the_policy():
        logger.info("npu_flashrl: reward/teacher model engine %s left as configured",
                    getattr(engine_args, "model", None))
        return None
    if server is not None:
        # e.g. verl's server mode: one engine per verl replica, entry `replica_rank % n`
        server.check_engine_quantization(engine_args)
        dp_rank = server.replica_rank() if len(cfg.entries) > 1 else 0
    else:
        tp = int(getattr(engine_args, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(engine_args, "pipeline_parallel_size", 1) or 1)
        dp_rank = flashrl_config.dp_rank_from_env(tp, pp) if len(cfg.entries) > 1 else 0
    entry = flashrl_config.select_entry(cfg, dp_rank)
    backend = getattr(engine_args, "distributed_executor_backend", None)
    # FlashRL-style syncs reach the model only in external_launcher (SPMD) engines, or through
    # verl's update_weights_from_ipc (wrapped by adapters.verl.server_mode) in a verl server engine; an
    # entry without the key still needs one, or the INT8 path would be bypassed silently.
    required = entry.distributed_executor_backend or flashrl_config.EXTERNAL_LAUNCHER
    if server is None and backend != required:
        raise UnquantizedRolloutError(
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
    if flashrl_config.is_quantized(entry):
        _refuse_fp16_int8(getattr(engine_args, "dtype", None), entry)
        # explicit: the compressed-tensors override answers "ascend" only for this engine's build
        engine_args.quantization = "ascend"
        if flashrl_config.needs_profile(entry):
            from npu_flashrl.profile import load_profile

            load_profile(entry.profile_path(engine_args.model))  # a bad profile fails here, named
    else:
        engine_args.quantization = entry.quantization
    _record_choice(engine_args, entry, dp_rank)
    logger.info("npu_flashrl: DP group %d uses config entry fn=%s model=%s load_format=%s",
                dp_rank, entry.fn, engine_args.model, getattr(engine_args, "load_format", None))
    return entry


def refuse_if_patches_failed(cfg, what: str) -> None:
    """With a FlashRL config that quantizes any entry active (`cfg`), a required patch that could
    not be applied in this process makes `what` refuse (`patches.RequiredPatchError`), never a
    silent bf16 rollout."""
    if cfg is not None and any(flashrl_config.is_quantized(e) for e in cfg.entries):
        patches.refuse_if_required_failed(what)


def _wrap(original):
    def create_engine_config(self, *args, **kwargs):
        cfg = _config[0]
        refuse_if_patches_failed(cfg, "the vLLM engine build")
        entry = apply_entry(self, cfg) if cfg is not None else None
        # the engine's own choice (recorded above, or passed by the caller) rules its build
        with building(engine_choice(self)):
            vllm_config = original(self, *args, **kwargs)
        if entry is not None and flashrl_config.is_quantized(entry):
            built = getattr(getattr(vllm_config, "model_config", None), "quantization", None)
            if built != "ascend":  # no silent bf16 rollout
                raise UnquantizedRolloutError(
                    f"npu_flashrl: FLASHRL_CONFIG entry fn={entry.fn} asks for an INT8 rollout but "
                    f"vLLM resolved the engine's quantization to {built!r}, not 'ascend': the model "
                    "would run unquantized. Check that vllm-ascend is installed and its platform "
                    "is active in this process, or use a bf16 entry")
            # dtype "auto" resolves to the checkpoint's dtype only here
            _refuse_fp16_int8(getattr(vllm_config.model_config, "dtype", None), entry)
        return vllm_config
    return create_engine_config


@patches.register(PATCH_NAME, TARGET, "vllm " + ", ".join(ln.vllm for ln in lines.LINES),
                  "FlashRL config applied per DP group / verl replica to every vLLM engine it can reach; "
                  "other engines refused", required=True)
def _apply() -> None:
    patches.replace(TARGET, _wrap)
