"""The emulated torch_npu answers the device queries upstream code makes on a CPU host as
torch_npu documents them, and an optional package it is not asked to emulate (torchair) is missing
as on an NPU host without it (issue 43).

verl 0.9.1 picks its NPU platform when torch_npu imports and asks `torch.npu.get_device_capability`
at import of `verl/trainer/constants_ppo.py`; vllm-ascend 0.23 imports torchair under
`except ImportError`. Each case runs in a fresh interpreter: the emulation is process-global.
Stand-ins: the emulation itself (no NPU).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(code, **env_over):
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("TORCH_NPU_DEVICE_CAPABILITY", None)
    env.update(env_over)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CAPABILITY = """
    import json, torch
    from npu_flashrl.kernels import emulation
    emulation.install()
    out = {}
    for name, fn in (("torch.npu", torch.npu.get_device_capability),
                     ("torch_npu.npu", __import__("torch_npu").npu.get_device_capability)):
        try:
            out[name] = fn(0)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    out["initialized"] = torch.npu.is_initialized()
    print(json.dumps(out))
"""


def test_device_capability_is_none_by_default():
    assert _run(_CAPABILITY) == {"torch.npu": None, "torch_npu.npu": None, "initialized": False}


def test_device_capability_from_torch_npu_env():
    assert _run(_CAPABILITY, TORCH_NPU_DEVICE_CAPABILITY="9.0")["torch.npu"] == [9, 0]
    bad = _run(_CAPABILITY, TORCH_NPU_DEVICE_CAPABILITY="nine")["torch.npu"]
    assert bad.startswith("ValueError") and "TORCH_NPU_DEVICE_CAPABILITY='nine'" in bad


def test_verl_constants_import_on_the_emulated_platform():
    """verl's platform detection takes the emulated torch_npu for an NPU host: its constants
    module, which asks the device capability at import, must import."""
    pytest.importorskip("verl")
    r = _run("""
        import json
        from npu_flashrl.kernels import emulation
        emulation.install()
        import verl.trainer.constants_ppo  # noqa: F401
        from verl.utils.device import get_device_capability, get_device_name
        print(json.dumps({"device": get_device_name(), "capability": list(get_device_capability())}))
    """)
    assert r == {"device": "npu", "capability": [None, None]}


def test_torchair_is_missing_unless_asked_for():
    r = _run("""
        import json
        from npu_flashrl.kernels import emulation
        emulation.install()
        out = {}
        try:
            import torchair  # noqa: F401
            out["default"] = "imported"
        except ImportError as exc:
            out["default"] = type(exc).__name__
        emulation.install(("torch_npu", "torchair"))
        import torchair
        out["asked"] = bool(getattr(torchair, "__npu_flashrl_emulated__", False))
        try:
            emulation.install(("torchair",))
        except ValueError as exc:
            out["bad"] = str(exc)
        print(json.dumps(out))
    """)
    assert r["default"] == "ModuleNotFoundError" and r["asked"] is True
    assert "expected torch_npu" in r["bad"]


def test_a_conftest_stand_in_torch_npu_is_kept():
    """vllm-ascend's tests/ut/conftest.py puts a bare torch_npu module in sys.modules before any
    test: the emulation installs beside it (it is no real torch_npu) and keeps it."""
    r = _run("""
        import importlib.util, json, sys, types
        mod = types.ModuleType("torch_npu")
        mod.__spec__ = importlib.util.spec_from_loader("torch_npu", loader=None)
        mod.__path__ = []
        sys.modules["torch_npu"] = mod
        from npu_flashrl.kernels import emulation
        emulation.install()
        import torch_npu.contrib as contrib
        print(json.dumps({"kept": sys.modules["torch_npu"] is mod,
                          "submodule": bool(getattr(contrib, "__npu_flashrl_emulated__", False))}))
    """)
    assert r == {"kept": True, "submodule": True}
