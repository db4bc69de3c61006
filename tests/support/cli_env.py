"""What the bad-input tests of the CLI (tests/cli/test_bad_input*.py) give the `npu-flashrl`
subprocesses they run (imported as `cli_env`: tests/support is on sys.path): the environment, a
capability drop for a root test process, a torch_npu that fails to import."""
import ctypes
import os
import subprocess
import sys
from typing import Dict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cli_env(**extra) -> Dict[str, str]:
    """This environment without the user's FlashRL / npu_flashrl settings, this checkout first on
    PYTHONPATH, no vLLM plugins, no torch_npu autoload, offline; `extra` on top (None: removed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "NPU_FLASHRL_"))}
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), VLLM_PLUGINS="none", TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def drop_dac():
    """preexec_fn: drop CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2) so file modes apply to root."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def can_drop_dac() -> bool:
    """Whether a subprocess of this one can drop them (always, for a non-root user)."""
    if os.geteuid() != 0:
        return True
    try:
        proc = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=drop_dac, capture_output=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def broken_torch_npu(tmp_path) -> str:
    """A directory for PYTHONPATH with a `torch_npu` package whose import raises ImportError, as
    a torch_npu without CANN's libascendcl.so does."""
    pkg = tmp_path / "fake_site" / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('libascendcl.so: cannot open shared object file')\n")
    return str(tmp_path / "fake_site")
