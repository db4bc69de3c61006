"""The verl side of a stack line: which verl config line a job runs, and how the installed verl
drives its rollout (decided without importing verl: its rollout package imports Ray and vLLM).

verl config lines are named by the release whose `algorithm.rollout_correction` schema they have:
"51d2104" (the pin; verl 0.6.x has the same schema: sync-mode rollout, `use_policy_gradient`)
and "0.9" (verl 0.7.1 .. 0.9.x: server-mode rollout, `use_policy_gradient` replaced by
`loss_type`, `rollout_rs_threshold_lower` / `rollout_token_veto_threshold` gone).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

SYNC, SERVER = "51d2104", "0.9"
SYNC_PIN = "51d2104ecb61563c41123a8f0bce2f06b18387dc"  # the verl commit the sync-mode line pins
VERL_LINES = (SYNC, SERVER)
# accepted spellings: releases, and the CPU test-stack line names (pinned, 0.11, current)
VERL_ALIASES = {"51d2104": SYNC, "pinned": SYNC, "0.6": SYNC, "0.6.1": SYNC, "0.11": SYNC,
                "0.9": SERVER, "0.9.1": SERVER, "current": SERVER}
# What the server-mode line's verl (0.9.1) registers in CheckpointEngineRegistry
# (verl/checkpoint_engine/*.py, `@CheckpointEngineRegistry.register(...)`): the names
# `actor_rollout_ref.rollout.checkpoint_engine.backend` takes. On Ascend `nccl` is verl's
# HCCLCheckpointEngine (it registers that name); there is no `hccl` backend name.
CHECKPOINT_ENGINES = ("naive", "nccl", "nixl", "delta_sharded", "kimi_ckpt_engine", "mooncake")
# verl's trainer entry points: the plain PPO trainer and the server-mode line's experimental ones
# (a rollout pool of its own), each with the YAML merged over ppo_trainer (relative to verl/).
ENTRY_MAIN = "verl.trainer.main_ppo"
ENTRY_EXPERIMENTAL = {
    "verl.experimental.one_step_off_policy.main_ppo":
        ("experimental", "one_step_off_policy", "config", "one_step_off_ppo_trainer.yaml"),
    "verl.experimental.fully_async_policy.fully_async_main":
        ("experimental", "fully_async_policy", "config", "fully_async_ppo_trainer.yaml"),
}
# the dtypes verl hands to vLLM as `rollout.dtype` (vLLM's ModelConfig takes these float types;
# an integer type such as int8 is not a model dtype: INT8 rollouts come from FLASHRL_CONFIG)
ROLLOUT_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
# the verl releases each config line's rules were read from, for messages
RELEASES = {SYNC: "verl 51d2104", SERVER: "verl 0.9.1"}
# the file verl's server-mode (bucketed IPC) sync lives in
_SERVER_SYNC_FILE = ("workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py")


def verl_server_mode() -> bool:
    """Does the installed verl run its rollout as a vLLM server fed by bucketed IPC syncs
    (the "0.9" config line), rather than in-process (sync mode, the "51d2104" line)? Decided by
    the file verl's server-mode sync lives in."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isfile(os.path.join(d, *_SERVER_SYNC_FILE))
               for d in spec.submodule_search_locations)


def verl_line(name: Optional[str] = None, server_mode=None) -> str:
    """The verl config line: `name` normalised ("0.9.1", "current" -> "0.9"; "0.6.1", "pinned"
    -> "51d2104"), or when None the installed verl's line (the pin's when verl is absent, e.g. a
    recipe generated on a machine without verl; `server_mode`: how to ask, default
    `verl_server_mode`). ValueError names the accepted values."""
    if name is None:
        return SERVER if (server_mode or verl_server_mode)() else SYNC
    try:
        return VERL_ALIASES[str(name).strip().lower()]
    except KeyError:
        raise ValueError(f"verl line {name!r} is not known; use one of {', '.join(VERL_LINES)} "
                         f"(aliases: {', '.join(sorted(VERL_ALIASES))})") from None


def is_server_line(name: str) -> bool:
    """Whether verl config line `name` (normalised by `verl_line`) is the server-mode one."""
    return verl_line(name) == SERVER
