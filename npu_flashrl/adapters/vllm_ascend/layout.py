"""The installed vllm-ascend line as the adapter sees it (decided once per process).

`current()` is the `npu_flashrl.lines` line object: what differs per vllm-ascend release (the W8A8
classes, the run-once rule, the derived tensors, the patches) is asked of it; this package names
no version.
"""
from __future__ import annotations

from npu_flashrl import lines


def current() -> lines.StackLine:
    """The installed line (`lines.line()`): method_classes, linear_wrapper_class,
    unsupported_reason, is_processed, commit_extras, commit_moe_extras, refresh_static,
    quant_config_class, PATCHES."""
    return lines.line()
