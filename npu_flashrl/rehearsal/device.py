"""Device and process environment: which device runs the rollout, and what vLLM reads at import."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Tuple

from npu_flashrl.rehearsal.common import RehearsalError


def resolve_device(choice: str) -> Tuple[str, bool]:
    """(device, emulated). npu needs a real, working torch_npu; the CPU emulation refuses to shadow a
    real torch_npu, so --device cpu needs an environment without one."""
    from npu_flashrl.kernels import emulation

    if not emulation.real_torch_npu_importable():
        if choice == "npu":
            raise RehearsalError("--device npu: torch_npu is not installed (install torch_npu + CANN, "
                                 "scripts/install_pinned.sh; or use --device cpu)")
        return "cpu", True
    if choice == "cpu":
        raise RehearsalError("--device cpu: a real torch_npu is installed here and the CPU emulation will "
                             "not shadow it; use --device npu, or a venv without torch_npu "
                             "(scripts/bootstrap_cpu_stack.sh)")
    try:
        import torch
        import torch_npu  # noqa: F401

        works = bool(torch.npu.is_available())
        problem = "no NPU is visible (torch.npu.is_available() is False)"
    except Exception as exc:  # noqa: BLE001 - e.g. CANN missing: libhccl.so not found
        works, problem = False, f"importing torch_npu failed: {type(exc).__name__}: {exc}"
    if not works:
        raise RehearsalError(f"--device {choice}: torch_npu is installed but not working: {problem} "
                             "(`source /usr/local/Ascend/ascend-toolkit/set_env.sh`?)")
    return "npu", False


def prepare_environment(device: str, verbose: bool) -> None:
    """Environment read at import time by vLLM (not imported yet when this runs); set only what the user
    did not set. TORCH_DEVICE_BACKEND_AUTOLOAD only matters to a process that has not imported torch yet
    (scripts/run.sh exports it)."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        # Autoloading a stray torch_npu breaks `import torch` on CPU; vllm-ascend's platform plugin
        # needs the real torch_npu. cpu_vllm selects vLLM's CPU platform itself.
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
        os.environ.setdefault("VLLM_PLUGINS", "none")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # no KV cache is used; silences a warning


@contextlib.contextmanager
def quiet_logs(verbose: bool):
    """npu_flashrl and transformers at WARNING for the run (restored after)."""
    if verbose:
        yield
        return
    ours = logging.getLogger("npu_flashrl")
    old = ours.level
    ours.setLevel(logging.WARNING)
    tf_old = None
    try:
        import transformers

        tf_old = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
    except ImportError:
        transformers = None  # type: ignore
    try:
        yield
    finally:
        ours.setLevel(old)
        if tf_old is not None:
            transformers.logging.set_verbosity(tf_old)
