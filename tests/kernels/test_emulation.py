"""torch_npu / torchair emulation: what vllm_ascend needs imports, quant ops are the reference
kernels, everything else fails loudly with its name, and it never installs over a real torch_npu.

The emulation is process-wide and other tests rely on it, so this file only installs it (never
uninstalls); the refusal case runs in a fresh interpreter.
"""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from npu_flashrl.kernels import emulation, int4_moe, reference

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line


@pytest.fixture(scope="module")
def torch_npu():
    emulation.install(emulation.EMULATED_PACKAGES)  # torchair too (optional: only when asked)
    import torch_npu as mod

    return mod


def test_quant_ops_are_the_reference_kernels(torch_npu):
    assert torch_npu.__npu_flashrl_emulated__ is True
    assert torch_npu.npu_dynamic_quant is reference.npu_dynamic_quant
    # npu_quantize: the int4-aware entry (quint4x2 for W4A8 MoE), which hands qint8 / quint8 /
    # int32 to reference.npu_quantize (tests/kernels/test_int4_moe.py)
    assert torch_npu.npu_quantize is int4_moe.npu_quantize
    assert torch_npu.npu_quant_matmul is reference.npu_quant_matmul
    assert torch_npu.npu_format_cast is reference.npu_format_cast
    assert torch_npu.npu_format_cast_ is reference.npu_format_cast_
    assert torch_npu.get_npu_format is reference.get_npu_format
    y, _ = torch_npu.npu_dynamic_quant(torch.tensor([[0.7261, 0.3726, 0.9126]], dtype=torch.float16))
    assert y.tolist() == [[101, 52, 127]]


def test_non_emulated_op_raises_with_full_name(torch_npu):
    with pytest.raises(NotImplementedError, match=r"^torch_npu\.npu_rms_norm is not emulated$"):
        torch_npu.npu_rms_norm(torch.ones(2, 4), torch.ones(4))
    with pytest.raises(NotImplementedError, match=r"torch_npu\._npu_flash_attention is not emulated"):
        torch_npu._npu_flash_attention()
    import torchair

    with pytest.raises(NotImplementedError, match=r"torchair\.get_npu_backend is not emulated"):
        torchair.get_npu_backend()


def test_submodules_import(torch_npu):
    from torch_npu.npu.streams import Event

    with pytest.raises(NotImplementedError, match=r"torch_npu\.npu\.streams\.Event is not emulated"):
        Event()
    import torchair
    from torchair.scope import npu_wait_tensor

    assert torchair.__npu_flashrl_emulated__ is True
    with pytest.raises(NotImplementedError, match=r"torchair\.scope\.npu_wait_tensor is not emulated"):
        npu_wait_tensor(torch.ones(1), torch.ones(1))
    # a nested attribute path keeps its full name
    with pytest.raises(NotImplementedError, match=r"torch_npu\.contrib\.function\.npu_silu is not emulated"):
        torch_npu.contrib.function.npu_silu(torch.ones(1))


def test_stand_in_can_be_subclassed(torch_npu):
    class MyEvent(torch_npu.npu.Event):
        extra = 1

    assert MyEvent.extra == 1
    assert isinstance(MyEvent, type)
    with pytest.raises(NotImplementedError, match=r"torch_npu\.npu\.Event is not emulated"):
        MyEvent()


def test_torch_npu_namespace(torch_npu):
    assert torch.npu is torch_npu.npu
    assert torch.npu.is_available() is False
    assert torch.npu.device_count() == 0
    # other torch.npu attributes are stand-ins too (vllm_ascend reads torch.npu.Stream at import)
    with pytest.raises(NotImplementedError, match=r"torch_npu\.npu\.Stream is not emulated"):
        torch.npu.Stream()


def test_install_is_idempotent(torch_npu):
    emulation.install()
    emulation.install()
    assert sum(1 for f in sys.meta_path if f is emulation._FINDER) == 1
    assert emulation.is_installed()
    import torch_npu as again

    assert again is torch_npu
    assert emulation.real_torch_npu_importable() is False


def test_vllm_ascend_quant_modules_import(torch_npu):
    pytest.importorskip("vllm")
    pytest.importorskip("vllm_ascend")
    from npu_flashrl.sim.cpu_vllm import prepare_process

    from npu_flashrl import lines
    prepare_process()
    # the line's own modules (0.23: modelslim_config / method_adapters / methods.w8a8_*)
    ln = lines.current()
    linear, static, dynamic = (ln.linear_wrapper_class(), ln.method_class("W8A8", "linear"),
                               ln.method_class("W8A8_DYNAMIC", "linear"))
    assert lines.current().quant_config_class().__name__ in ("AscendQuantConfig", "AscendModelSlimConfig")
    assert linear.__name__ == "AscendLinearMethod"
    w8a8 = importlib.import_module(static.__module__)
    dyn = importlib.import_module(dynamic.__module__)
    assert static.__name__ == "AscendW8A8LinearMethod"
    assert dynamic.__name__ == "AscendW8A8DynamicLinearMethod"
    # they bound the emulated module, whose quant ops are the reference kernels
    assert w8a8.torch_npu is torch_npu
    assert dyn.torch_npu.npu_quant_matmul is reference.npu_quant_matmul


def _run_fresh(code: str, extra_path: str = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    parts = [p for p in (extra_path, repo, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_refuses_to_install_over_real_torch_npu(tmp_path):
    # A fake "real" torch_npu package on PYTHONPATH, in a fresh interpreter (this process's
    # emulation is unaffected). Importing it would print a marker: install() must detect it
    # without importing it, and must not put the emulation in place.
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("print('FAKE_TORCH_NPU_IMPORTED')\n")
    code = """
        import sys
        from npu_flashrl.kernels import emulation
        assert emulation.real_torch_npu_importable()
        try:
            emulation.install()
        except emulation.RealTorchNpuPresent as e:
            print("REFUSED:", e)
        else:
            print("INSTALLED")
        print("FINDER:", emulation.is_installed())
        print("TORCH_NPU_LOADED:", "torch_npu" in sys.modules)
    """
    r = _run_fresh(code, extra_path=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "REFUSED:" in out and "INSTALLED" not in out
    msg = out.split("REFUSED:", 1)[1].splitlines()[0]
    assert "real torch_npu is importable" in msg
    # it says what to do instead
    assert "venv without torch_npu" in msg and "bootstrap_cpu_stack.sh" in msg
    assert "FINDER: False" in out
    assert "TORCH_NPU_LOADED: False" in out and "FAKE_TORCH_NPU_IMPORTED" not in out


def test_installs_in_fresh_interpreter_without_torch_npu():
    # Control for the refusal test: same subprocess set-up, no fake package -> installs.
    code = """
        from npu_flashrl.kernels import emulation
        emulation.install()
        import torch, torch_npu
        print("OK", torch_npu.__npu_flashrl_emulated__, torch.npu.is_available())
    """
    r = _run_fresh(code)
    assert r.returncode == 0, r.stderr
    assert "OK True False" in r.stdout
