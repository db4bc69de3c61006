"""torch_npu / torchair emulation for NPU-free tests and CI.

`install()` puts stand-in `torch_npu` and `torchair` packages in place through a meta-path finder
so that vllm_ascend imports on a CPU. The quant ops vllm-ascend's W8A8 layers call are backed by
the reference kernels (`npu_flashrl.kernels.reference`); every other attribute is a named
stand-in: importing, subclassing or reading it works, CALLING it raises
`NotImplementedError("torch_npu.<name> is not emulated")`. A `torch.npu` namespace is added the
same way (it reports no device available).

It refuses to install where a real torch_npu is importable: emulating over real hardware support
would silently replace NPU kernels.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Dict, List

import torch

from npu_flashrl.kernels import reference

EMULATED_PACKAGES = ("torch_npu", "torchair")

# Ops computed by the reference kernels; the rest is stand-ins.
_TORCH_NPU_OPS = {
    "npu_quantize": reference.npu_quantize,
    "npu_dynamic_quant": reference.npu_dynamic_quant,
    "npu_quant_matmul": reference.npu_quant_matmul,
    "npu_format_cast": reference.npu_format_cast,
    "npu_format_cast_": reference.npu_format_cast_,
    "get_npu_format": reference.get_npu_format,
}


def _vllm_quantize(in_tensor, input_scale, input_scale_reciprocal, input_offset):
    # vllm-ascend's op body: npu_quantize(x, 1/scale, offset, qint8, -1, div_mode=False)
    return reference.npu_quantize(in_tensor, input_scale_reciprocal, input_offset, torch.qint8, -1, False)


# Custom ops vllm-ascend registers (vllm_ascend/ops/register_custom_ops.py, 0.23) with an NPU
# (PrivateUse1) kernel only; on a CPU they get the reference body through `register_cpu_ops()`.
_CUSTOM_OPS = {("vllm", "quantize"): _vllm_quantize}
_cpu_libs: Dict[str, object] = {}


def register_cpu_ops() -> List[str]:
    """Give the NPU-only custom ops that exist in this process a CPU kernel (idempotent; call
    after vllm-ascend registered them). Returns the qualified names registered now."""
    done = []
    for (ns, name), fn in _CUSTOM_OPS.items():
        qual = f"{ns}::{name}"
        if qual in _cpu_libs or not hasattr(getattr(torch.ops, ns), name):
            continue
        lib = torch.library.Library(ns, "IMPL")
        lib.impl(name, fn, "CPU")
        _cpu_libs[qual] = lib  # the registration lives as long as the Library object
        done.append(qual)
    return done


class RealTorchNpuPresent(RuntimeError):
    pass


class _StandIn:
    """A named placeholder for an upstream attribute that is not emulated.

    Attribute access yields further stand-ins (so `torch_npu.npu.streams.Event` resolves), it can
    be used as a base class or in annotations, and calling it raises NotImplementedError.
    """

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _StandIn(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is not emulated")

    def __mro_entries__(self, bases):
        return (_stand_in_class(self._name),)

    def __getitem__(self, item):
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<npu_flashrl stand-in {self._name}>"


_classes: Dict[str, type] = {}


def _stand_in_class(name: str) -> type:
    if name not in _classes:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"{name} is not emulated")
        _classes[name] = type(name.rsplit(".", 1)[-1], (), {"__init__": __init__,
                                                           "__module__": name.rsplit(".", 1)[0]})
    return _classes[name]


class _EmulatedModule(types.ModuleType):
    """A module whose unknown attributes are stand-ins named after their full path."""

    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        value = _StandIn(f"{self.__name__}.{item}")
        return value


class _NpuNamespace(_EmulatedModule):
    """`torch.npu` / `torch_npu.npu`: no device is available on an emulated machine."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0


def _build_module(fullname: str) -> types.ModuleType:
    if fullname in ("torch_npu.npu",):
        mod: types.ModuleType = _NpuNamespace(fullname)
    else:
        mod = _EmulatedModule(fullname)
    mod.__path__ = []  # a package: any submodule can be imported
    mod.__npu_flashrl_emulated__ = True
    if fullname == "torch_npu":
        mod.__version__ = "0.0.0+npu_flashrl.emulated"
        for name, fn in _TORCH_NPU_OPS.items():
            setattr(mod, name, fn)
    return mod


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _build_module(spec.name)

    def exec_module(self, module):
        if module.__name__ == "torch_npu":
            # Mirror the real package: `import torch_npu` makes `torch.npu` exist.
            module.npu = importlib.import_module("torch_npu.npu")
            torch.npu = module.npu


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in EMULATED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


_FINDER = _Finder()


def real_torch_npu_importable() -> bool:
    """True when a real torch_npu (not ours) could be imported in this process."""
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return not getattr(mod, "__npu_flashrl_emulated__", False)
    was = _FINDER in sys.meta_path
    if was:
        sys.meta_path.remove(_FINDER)
    try:
        return importlib.util.find_spec("torch_npu") is not None
    finally:
        if was:
            sys.meta_path.insert(0, _FINDER)


def is_installed() -> bool:
    return _FINDER in sys.meta_path


def install() -> None:
    """Install the emulation (idempotent). Raises RealTorchNpuPresent over a real torch_npu."""
    if is_installed():
        return
    if real_torch_npu_importable():
        raise RealTorchNpuPresent(
            "a real torch_npu is importable in this environment; npu_flashrl will not emulate it. "
            "Use the real NPU kernels, or run the CPU tests in a venv without torch_npu "
            "(scripts/bootstrap_cpu_stack.sh).")
    sys.meta_path.insert(0, _FINDER)
    importlib.import_module("torch_npu")


def uninstall() -> None:
    """Remove the finder and the emulated modules (for tests)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in list(sys.modules):
        if name.split(".", 1)[0] in EMULATED_PACKAGES and getattr(sys.modules[name], "__npu_flashrl_emulated__", False):
            del sys.modules[name]
    if isinstance(getattr(torch, "npu", None), _NpuNamespace):
        del torch.npu
