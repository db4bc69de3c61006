"""Turn npu_flashrl on in this process: the one entry point behind the vLLM plugin,
`import npu_flashrl` with FLASHRL_CONFIG set, and `npu_flashrl.activate()`.

Everything is idempotent: activating twice applies each patch once.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.config import lmhead_fp32_requested

logger = get_logger(__name__)

def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _installed(dist: str) -> bool:
    """By distribution metadata: asking the import system about `megatron` would trigger the
    MindSpeed import-order guard."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def activate(config_path: Optional[str] = None) -> Optional[dict]:
    """Load the FlashRL config (argument or FLASHRL_CONFIG) and apply the patches it needs.

    Returns {patch name: applied} or None when no config is set. A config that cannot be read
    raises ConfigError naming the file: a rollout must never silently run unquantized.
    """
    from npu_flashrl.config import load_config

    if config_path is None and not os.environ.get("FLASHRL_CONFIG", "").strip():
        return None
    cfg = load_config(config_path)
    from npu_flashrl.adapters import flashrl, vllm_ascend, vllm_engine

    names = []
    if _importable("vllm_ascend"):
        names += list(vllm_ascend.PATCHES)
    else:
        logger.warning("npu_flashrl: vllm_ascend is not installed; INT8 rollout patches skipped")
    if _importable("vllm"):
        names.append(vllm_engine.PATCH_NAME)
        if lmhead_fp32_requested():
            from npu_flashrl.adapters import vllm as vllm_adapter

            names += [vllm_adapter.PATCH_COMPUTE, vllm_adapter.PATCH_INIT]
    if _importable("flash_rl"):
        if flashrl.should_yield():
            names.append(flashrl.PATCH_NAME)
        else:
            logger.debug("npu_flashrl: FlashRL present but not on Ascend; its patches stay active")
    if _importable("verl"):
        from npu_flashrl.adapters import verl as verl_adapter

        names += [verl_adapter.PATCH_DRIVER, verl_adapter.PATCH_ACTOR]
        if _importable("vllm"):
            from npu_flashrl import compat

            if compat.verl_server_mode():  # server-mode verl: the syncs arrive in its vLLM workers
                # importing it registers verl's server engines with the engine patch
                from npu_flashrl.adapters.verl import server_mode

                names += list(server_mode.PATCHES)
                from npu_flashrl.adapters.verl import checkpoint_engine  # one-step-off / fully-async

                names += list(checkpoint_engine.PATCHES)
            else:
                names.append(verl_adapter.PATCH_SYNC_END)  # rollout workers: every sync ends checked
        if lmhead_fp32_requested() and _importable("transformers"):
            from npu_flashrl.adapters import transformers as hf_adapter

            names.append(hf_adapter.PATCH_NAME)
        if _installed("megatron-core") or "megatron" in sys.modules:
            from npu_flashrl import compat
            from npu_flashrl.adapters import megatron as megatron_adapter

            # wait for verl's Megatron worker module (server-mode verl: its Megatron engine module);
            # cheap when the FSDP backend is used
            if compat.verl_server_mode():
                names += list(megatron_adapter.ENGINE_PATCHES)
            else:
                names += list(megatron_adapter.PATCHES)
                if lmhead_fp32_requested():
                    names.append(megatron_adapter.PATCH_LMHEAD)
    vllm_engine.set_config(cfg)  # what each engine then gets lives in that engine's config only
    return patches.apply_patches(names)


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
    if _installed("megatron-core") or _importable("mindspeed"):
        from npu_flashrl.adapters import megatron as megatron_adapter

        megatron_adapter.install_import_guard()
    activate()
