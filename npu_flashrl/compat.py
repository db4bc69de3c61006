"""Every upstream version difference npu_flashrl knows about, in one place.

Supported vllm-ascend lines: v0.10.1rc1 (the pinned production stack, with vllm 0.10.1) and
0.11.0 (with vllm 0.11.0; the line CI runs, as 0.10.x has no wheel). Anything else is refused by
`check_vllm_ascend()` with a message naming what is supported.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

SUPPORTED_VLLM_ASCEND = ("0.10.1rc1", "0.11.0")


class UnsupportedVersion(RuntimeError):
    pass


def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def vllm_ascend_line() -> str:
    """'0.10.1rc1' or '0.11.0', from the installed distribution or, for a source tree on
    PYTHONPATH (no metadata), from the module layout: v0.10.1rc1 maps quant types in
    `quantization/quantizer.py`, 0.11.0 in `quantization/utils.py`."""
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None:
        raise UnsupportedVersion("vllm_ascend is not installed; npu_flashrl supports vllm-ascend "
                                 f"{' and '.join(SUPPORTED_VLLM_ASCEND)}")
    origin_dir = list(spec.submodule_search_locations or [])[0]
    import os

    has_quantizer = os.path.exists(os.path.join(origin_dir, "quantization", "quantizer.py"))
    has_utils = os.path.exists(os.path.join(origin_dir, "quantization", "utils.py"))
    version = _dist_version("vllm_ascend") or _dist_version("vllm-ascend")
    in_site = version is not None and "site-packages" in origin_dir
    if in_site:
        base = version.split("+")[0]
        for line in SUPPORTED_VLLM_ASCEND:
            if base == line or (line == "0.10.1rc1" and base.startswith("0.10.1")):
                return line
        raise UnsupportedVersion(
            f"vllm-ascend {version} is not supported; npu_flashrl supports "
            f"{' and '.join(SUPPORTED_VLLM_ASCEND)} (see npu_flashrl/pins.yaml)")
    if has_quantizer:
        return "0.10.1rc1"
    if has_utils:
        return "0.11.0"
    raise UnsupportedVersion(f"cannot tell the vllm-ascend version of the tree at {origin_dir}; "
                             f"supported: {' and '.join(SUPPORTED_VLLM_ASCEND)}")


def check_vllm_ascend() -> str:
    return vllm_ascend_line()


def set_vllm_ascend_flags(is_310p: bool = False, enable_nz: bool = True) -> None:
    """Flags vllm-ascend normally reads from its build info / env (absent without the build).

    v0.10.1rc1 NZ-casts W8A8 weights unconditionally; 0.11.0 gates it by VLLM_ASCEND_ENABLE_NZ
    (`utils._ENABLE_NZ`)."""
    utils = importlib.import_module("vllm_ascend.utils")
    utils._IS_310P = is_310p
    if hasattr(utils, "_ENABLE_NZ"):
        utils._ENABLE_NZ = enable_nz


def init_vllm_ascend_config(vllm_config) -> None:
    """0.11.0's W8A8 `apply` reads the ascend config; initialise it when the line has one."""
    try:
        ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    except ImportError:
        return
    init = getattr(ascend_config, "init_ascend_config", None)
    if init is not None:
        init(vllm_config)


def import_quantization():
    """Import vllm-ascend's quantization package in the order vllm-ascend itself uses:
    quant_config first (it registers the "ascend" method with vLLM; importing w8a8_dynamic
    first hits a circular import through vllm_ascend.ops)."""
    return importlib.import_module("vllm_ascend.quantization.quant_config")


def quant_method_classes():
    """(AscendLinearMethod, W8A8 static, W8A8 dynamic) classes; same module paths in both lines."""
    qc = import_quantization()
    w8a8 = importlib.import_module("vllm_ascend.quantization.w8a8")
    dyn = importlib.import_module("vllm_ascend.quantization.w8a8_dynamic")
    return qc.AscendLinearMethod, w8a8.AscendW8A8LinearMethod, dyn.AscendW8A8DynamicLinearMethod


def ascend_quant_method_map():
    """The table vllm-ascend picks W8A8 scheme classes from (torchair graph mode rewrites it via
    `vllm_ascend.torchair.utils.torchair_quant_method_register`): v0.10.1rc1 keeps quantizer
    classes in `quantizer.SUPPORT_ASCEND_QUANTIZER_TYPE`, 0.11.0 method classes in
    `utils.ASCEND_QUANTIZATION_METHOD_MAP`. For tests that must restore it."""
    import_quantization()
    if vllm_ascend_line() == "0.10.1rc1":
        return importlib.import_module("vllm_ascend.quantization.quantizer").SUPPORT_ASCEND_QUANTIZER_TYPE
    return importlib.import_module("vllm_ascend.quantization.utils").ASCEND_QUANTIZATION_METHOD_MAP


def nz_flag_target():
    """(module, attribute) that switches the NZ cast of W8A8 weights, for tests to monkeypatch:
    0.11.0 gates it by `utils._ENABLE_NZ` (VLLM_ASCEND_ENABLE_NZ). None on v0.10.1rc1, which
    casts unconditionally."""
    utils = importlib.import_module("vllm_ascend.utils")
    return (utils, "_ENABLE_NZ") if hasattr(utils, "_ENABLE_NZ") else None


def nz_enabled() -> bool:
    utils = importlib.import_module("vllm_ascend.utils")
    if hasattr(utils, "is_enable_nz"):
        try:
            return bool(utils.is_enable_nz())
        except ValueError:  # not initialised yet
            return bool(getattr(utils, "_ENABLE_NZ", False))
    return True  # v0.10.1rc1: unconditional NZ cast


def compute_logits(model, hidden_states):
    """Logits from a vLLM model's final hidden states, outside the engine (no sampler).

    vLLM 0.10.1's `compute_logits(hidden_states, sampling_metadata)` requires the metadata
    argument (None skips pruning and logits processors); 0.11.0 dropped it."""
    import inspect

    params = inspect.signature(model.compute_logits).parameters
    if "sampling_metadata" in params:
        return model.compute_logits(hidden_states, None)
    return model.compute_logits(hidden_states)


# Where vLLM's model loader looks things up (patched by adapters.vllm_ascend).
GET_QUANT_CONFIG_TARGET = "vllm.model_executor.model_loader.weight_utils:get_quant_config"
INITIALIZE_MODEL_TARGET = "vllm.model_executor.model_loader.base_loader:initialize_model"
