"""Errors shared by the command line and the commands it hosts (no imports: anything may use it)."""
from __future__ import annotations


class CliError(Exception):
    """An error to print as `npu-flashrl <cmd>: error: ...` with exit code `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class UnquantizedRolloutError(RuntimeError):
    """An engine the FlashRL config asks to run INT8 would run unquantized (its quantization was
    resolved or replaced to something else, or its model has no W8A8 layers): refused, never a
    silent bf16 rollout."""
