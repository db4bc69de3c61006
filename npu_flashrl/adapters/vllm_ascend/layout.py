"""Which layout module describes the installed vllm-ascend (decided once per process).

A layout module (`layout_011`, ...) holds everything line-specific the adapter needs: patch
targets, the quant-config class, the W8A8 method classes and their derived tensors. The rest of
this package asks `current()` and names no version.
"""
from __future__ import annotations

import functools
import importlib

from npu_flashrl import compat


@functools.lru_cache(maxsize=None)
def current():
    """The layout module of compat's line (`compat.line().layout`: "011" for v0.10.1rc1 and
    0.11.0, which share the quantization layout; "023" for 0.23.0)."""
    return importlib.import_module(f"npu_flashrl.adapters.vllm_ascend.layout_{compat.line().layout}")
