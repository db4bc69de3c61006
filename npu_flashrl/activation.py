"""Turn npu_flashrl on in this process: the one entry point behind the vLLM plugin,
`import npu_flashrl` with FLASHRL_CONFIG set, and `npu_flashrl.activate()`.

Everything is idempotent: activating twice applies each patch once.
"""
from __future__ import annotations

import os
from typing import Optional

from npu_flashrl import patches
from npu_flashrl._logging import get_logger

logger = get_logger(__name__)


def activate(config_path: Optional[str] = None) -> Optional[dict]:
    """Load the FlashRL config (argument or FLASHRL_CONFIG) and arm the patches it needs.

    Nothing upstream is imported here: a patch whose target module is imported already is
    applied at once, the others when this process imports their module (`patches.arm_patch`), so
    a process that never builds a rollout never imports vLLM, verl's device probe or transformers
    for npu_flashrl's sake. Returns {patch name: True (applied) | False (cannot be, WARNING
    logged) | patches.Pending (true: applied when its module is imported)}, or None when no
    config is set. A config that cannot be read raises ConfigError naming the file: a rollout
    must never silently run unquantized.
    """
    from npu_flashrl.config import load_config

    if config_path is None and not os.environ.get("FLASHRL_CONFIG", "").strip():
        return None
    cfg = load_config(config_path)
    from npu_flashrl.adapters import registry, vllm_engine

    proc = registry.Process.probe()
    if not proc.vllm_ascend:
        logger.warning("npu_flashrl: vllm_ascend is not installed; INT8 rollout patches skipped")
    names = registry.patch_names(proc)  # each adapter declares when it applies
    vllm_engine.set_config(cfg)  # what each engine then gets lives in that engine's config only
    return patches.arm_patches(names)


def active_config():
    """The FlashRL config activated in this process (None before `activate`)."""
    from npu_flashrl.adapters import vllm_engine

    return vllm_engine.current_config()


def worker_process_setup() -> None:
    """Ray `worker_process_setup_hook`: activate in every trainer AND rollout worker process at
    start, before verl builds any model. The vLLM plugin alone activates only when the rollout
    engine starts, after the trainer's model exists (too late for the trainer-side FP32 lm-head)
    and after Megatron is imported (too late for the MindSpeed import-order guard).

        ++ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=npu_flashrl.activation.worker_process_setup

    (the recipes in tests/verl_examples set it already; '++' also composes with theirs)
    """
    from npu_flashrl.adapters.registry import importable, installed

    if installed("megatron-core") or importable("mindspeed"):
        from npu_flashrl.adapters import megatron as megatron_adapter

        megatron_adapter.install_import_guard()
    activate()
