"""The package's error base (no imports from npu_flashrl: anything may import this module).

Every exception npu_flashrl raises on purpose derives from `NpuFlashrlError`, so a caller can catch
"anything npu_flashrl refused" in one clause. Each specific class keeps its builtin base too
(`ConfigError` is still a `ValueError`, `PatchNotApplicable` a `RuntimeError`, ...), so existing
`except ValueError` / `except RuntimeError` callers keep working.
"""
from __future__ import annotations


class NpuFlashrlError(Exception):
    """Base of every npu_flashrl exception (the specific classes say what went wrong)."""


class CliError(NpuFlashrlError):
    """An error to print as `npu-flashrl <cmd>: error: ...` with exit code `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class UnquantizedRolloutError(NpuFlashrlError, RuntimeError):
    """An engine the FlashRL config asks to run INT8 would run unquantized (its quantization was
    resolved or replaced to something else, or its model has no W8A8 layers): refused, never a
    silent bf16 rollout."""


class ProfileError(NpuFlashrlError, ValueError):
    """A profile (or a checkpoint it is computed from) that cannot be used; names file and tensor."""


class ArchitectureRefusedError(NpuFlashrlError, RuntimeError):
    """An INT8 rollout of a model architecture that the installed stack line cannot keep right
    across weight syncs (`StackLine.refused_architectures`): refused at setup, verify and engine
    build, naming the reason and what to run instead."""
