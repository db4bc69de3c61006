"""Test harness: the real upstream code on CPU with emulated torch_npu.

Environment is fixed here before anything imports torch or vLLM: no torch device-backend
autoload (a stray torch_npu would break `import torch`), and vLLM plugins only as a test asks.
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("FLASHRL_CONFIG", None)

# Optional: run against a vllm-ascend SOURCE TREE instead of the installed distribution, e.g. the
# pinned v0.10.1rc1 line (no wheel exists): NPU_FLASHRL_VLLM_ASCEND_SRC=<dir containing
# vllm_ascend/>. Prepended to sys.path here, before any test imports vllm_ascend; also exported
# through PYTHONPATH so subprocesses the tests start see the same tree.
_VLLM_ASCEND_SRC = os.environ.get("NPU_FLASHRL_VLLM_ASCEND_SRC")
if _VLLM_ASCEND_SRC:
    import sys

    _VLLM_ASCEND_SRC = os.path.abspath(_VLLM_ASCEND_SRC)
    if not os.path.isdir(os.path.join(_VLLM_ASCEND_SRC, "vllm_ascend")):
        raise RuntimeError(f"NPU_FLASHRL_VLLM_ASCEND_SRC={_VLLM_ASCEND_SRC} has no vllm_ascend/ "
                           "package directory")
    if "vllm_ascend" in sys.modules:
        raise RuntimeError("vllm_ascend was imported before tests/conftest.py could put "
                           f"{_VLLM_ASCEND_SRC} first on sys.path")
    if _VLLM_ASCEND_SRC not in sys.path:
        sys.path.insert(0, _VLLM_ASCEND_SRC)
    _pp = os.environ.get("PYTHONPATH", "")
    if _VLLM_ASCEND_SRC not in _pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = _VLLM_ASCEND_SRC + (os.pathsep + _pp if _pp else "")


import pytest  # noqa: E402  (after the environment is fixed)


@pytest.fixture(scope="module")
def va():
    """The vllm-ascend adapter with its patches applied on the CPU harness (emulated torch_npu);
    models built in the test get the online INT8 loader once a quantizer is configured."""
    from npu_flashrl import patches
    from npu_flashrl.testing import cpu_vllm

    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    yield vllm_ascend
    vllm_ascend.configure_online_quantization(None)
