"""Which layout module describes the installed vllm-ascend (decided once per process).

A layout module (`layout_011`, ...) holds everything line-specific the adapter needs: patch
targets, the quant-config class, the W8A8 method classes and their derived tensors. The rest of
this package asks `current()` and names no version.
"""
from __future__ import annotations

import functools
import importlib

from npu_flashrl import compat

# compat's line name -> layout module (v0.10.1rc1 and 0.11.0 share the quantization layout).
LAYOUTS = {
    "0.10.1rc1": "npu_flashrl.adapters.vllm_ascend.layout_011",
    "0.11.0": "npu_flashrl.adapters.vllm_ascend.layout_011",
}


@functools.lru_cache(maxsize=None)
def current():
    line = compat.vllm_ascend_line()
    try:
        return importlib.import_module(LAYOUTS[line])
    except KeyError:
        raise compat.UnsupportedVersion(f"vllm-ascend {line}: no npu_flashrl layout for it; "
                                        f"known: {sorted(LAYOUTS)}") from None
