"""Errors shared by the command line and the commands it hosts (no imports: anything may use it)."""
from __future__ import annotations


class CliError(Exception):
    """An error to print as `npu-flashrl <cmd>: error: ...` with exit code `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class ProfileError(ValueError):
    """A profile (or a checkpoint it is computed from) that cannot be used; names file and tensor."""
