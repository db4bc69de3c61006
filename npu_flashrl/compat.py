"""Detection, re-exported from `npu_flashrl.lines` (where every version difference lives) for the
modules that ask for it by this name: the installed vllm-ascend line (`line()`, decided once per
process), the verl line, and the import helpers the runtime uses. The CPU harness's half of the
former compat (NZ flags, MoE forward context, HCCL stand-ins, ...) is
`npu_flashrl.sim.ascend_harness`.
"""
from __future__ import annotations

from typing import Optional, Tuple

from npu_flashrl.lines import (  # noqa: F401
    GET_QUANT_CONFIG_TARGET, INITIALIZE_MODEL_TARGET, SUPPORTED_VLLM_ASCEND, VERL_LINES, StackLine,
    UnsupportedVersion, line, line_for_tree, line_for_version, verl_server_mode)
from npu_flashrl.lines import verl as _verl


def verl_line(name: Optional[str] = None) -> str:
    """`lines.verl_line`, asking this module's `verl_server_mode` (which tests may replace)."""
    return _verl.verl_line(name, server_mode=lambda: verl_server_mode())


def import_quantization():
    """Import the installed line's vllm-ascend quantization config module (registers "ascend")."""
    return line().import_quantization()


def quant_config_class() -> type:
    return line().quant_config_class()


def quant_method_classes() -> Tuple[type, type, type]:
    """(AscendLinearMethod, W8A8 static scheme, W8A8_DYNAMIC scheme) of the installed line."""
    return line().quant_method_classes()


def moe_method_class() -> type:
    """vllm-ascend's W8A8_DYNAMIC fused-MoE scheme of the installed line."""
    return line().moe_method_class()
