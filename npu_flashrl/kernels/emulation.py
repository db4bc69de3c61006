"""torch_npu / torchair emulation for NPU-free tests and CI.

`install()` puts a stand-in `torch_npu` package (and, when asked, `torchair`; otherwise that
optional package stays missing) in place through a meta-path finder so that vllm_ascend imports on
a CPU. The quant ops vllm-ascend's W8A8 layers call are backed by
the reference kernels (`npu_flashrl.kernels.reference`), the fused-MoE ops of its W8A8_DYNAMIC
MoE path by `npu_flashrl.kernels.moe_reference` (torch_npu ops here; vllm-ascend's own compiled
`torch.ops._C_ascend.*` MoE ops through `register_cpu_ops()`); every other attribute is a named
stand-in: importing, subclassing or reading it works, CALLING it raises
`NotImplementedError("torch_npu.<name> is not emulated")`. A `torch.npu` namespace is added the
same way (it reports no device available and answers the device queries upstream code makes on a
CPU host as torch_npu documents them: `get_device_capability`).

It refuses to install where a real torch_npu is importable: emulating over real hardware support
would silently replace NPU kernels.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Dict, List

import torch

from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.kernels import dequant_swiglu_v2, int4, int4_moe, moe_reference, reference

EMULATED_PACKAGES = ("torch_npu", "torchair")  # what `install` can emulate
# What `install()` emulates unless asked for more: torchair is an optional package (vllm-ascend
# the current line imports it under `except ImportError`), so where it is not asked for, `import torchair`
# raises ModuleNotFoundError as on an NPU host without it. A line whose vllm-ascend imports it
# unguarded asks for it (`StackLine.emulated_packages`, passed by `sim.cpu_vllm`).
DEFAULT_PACKAGES = ("torch_npu",)

# Ops computed by the reference kernels; the rest is stand-ins.
_TORCH_NPU_OPS = {
    "npu_quantize": reference.npu_quantize,
    "npu_dynamic_quant": reference.npu_dynamic_quant,
    "npu_quant_matmul": reference.npu_quant_matmul,
    "npu_format_cast": reference.npu_format_cast,
    "npu_format_cast_": reference.npu_format_cast_,
    "get_npu_format": reference.get_npu_format,
    # fused MoE (the quant_config-layout lines call these torch_npu ops; the scheme-registry
    # layout its own _C_ascend ops below for routing / gmm+swiglu+quant, and these for the
    # grouped matmul and the unpermute)
    "npu_moe_gating_top_k": lambda x, k, *, bias=None, input_ids=None, tid2eid=None, **kw:
        _no_hash(x, k, bias, input_ids, tid2eid, **kw),
    "npu_moe_gating_top_k_softmax": moe_reference.npu_moe_gating_top_k_softmax,
    "npu_moe_init_routing_v2": moe_reference.npu_moe_init_routing_v2,
    "npu_moe_token_unpermute": moe_reference.npu_moe_token_unpermute,
    "npu_grouped_matmul": moe_reference.npu_grouped_matmul,
    "npu_grouped_matmul_swiglu_quant": moe_reference.npu_grouped_matmul_swiglu_quant,
    "npu_dequant_swiglu_quant": moe_reference.npu_dequant_swiglu_quant,
    "npu_swiglu": moe_reference.npu_swiglu,
}


# W4A8_DYNAMIC linear (int4 packing and the weight-quant matmul): kernels/int4.py
_TORCH_NPU_OPS.update(int4.TORCH_NPU_OPS)
# W4A8_DYNAMIC fused MoE (quint4x2 packing, the A8W4 grouped matmul): kernels/int4_moe.py
_TORCH_NPU_OPS.update(int4_moe.TORCH_NPU_OPS)


def _no_hash(x, k, bias, input_ids, tid2eid, norm_type=1, **kw):
    # torch_npu's signature defaults norm_type to 1 (sigmoid), unlike vllm-ascend's own op
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError("torch_npu.npu_moe_gating_top_k: the hash mode (input_ids / "
                                  "tid2eid) is not emulated")
    return moe_reference.moe_gating_top_k(x, k, bias=bias, norm_type=norm_type, **kw)


def _vllm_quantize(in_tensor, input_scale, input_scale_reciprocal, input_offset):
    # vllm-ascend's op body: npu_quantize(x, 1/scale, offset, qint8, -1, div_mode=False)
    return reference.npu_quantize(in_tensor, input_scale_reciprocal, input_offset, torch.qint8, -1, False)


# Custom ops vllm-ascend registers (vllm_ascend/ops/register_custom_ops.py, the scheme-registry
# layout's releases) with an NPU
# (PrivateUse1) kernel only; on a CPU they get the reference body through `register_cpu_ops()`.
_CUSTOM_OPS = {("vllm", "quantize"): _vllm_quantize}
_cpu_libs: Dict[str, object] = {}


def _init_routing_custom(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                         expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                         expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=0,
                         active_expert_range=(), row_idx_type=0):
    return moe_reference.moe_init_routing(
        x, expert_idx, scale=scale, offset=offset, active_num=active_num,
        expert_capacity=expert_capacity, expert_num=expert_num, drop_pad_mode=drop_pad_mode,
        expert_tokens_num_type=expert_tokens_num_type,
        expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
        active_expert_range=active_expert_range, row_idx_type=row_idx_type)


def _gating_top_k(x, k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
                  routed_scaling_factor, eps, bias_opt=None):
    return moe_reference.moe_gating_top_k(
        x, k, bias=bias_opt, k_group=k_group, group_count=group_count,
        group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
        out_flag=out_flag, routed_scaling_factor=routed_scaling_factor, eps=eps,
        op="moe_gating_top_k")


def _dequant_swiglu_quant(x, *, weight_scale=None, activation_scale=None, bias=None,
                          quant_scale=None, quant_offset=None, group_index=None,
                          activate_left=True, quant_mode=0, swiglu_mode=0, clamp_limit=0.0,
                          glu_alpha=1.0, glu_bias=0.0):
    # vllm-ascend's own op (aclnnDequantSwigluQuantV2, swiglu_mode 0 / 1), not torch_npu's
    return dequant_swiglu_v2.npu_dequant_swiglu_quant(
        x, weight_scale=weight_scale, activation_scale=activation_scale, bias=bias,
        quant_scale=quant_scale, quant_offset=quant_offset, group_index=group_index,
        activate_left=activate_left, quant_mode=quant_mode, swiglu_mode=swiglu_mode,
        clamp_limit=clamp_limit, glu_alpha=glu_alpha, glu_bias=glu_bias)


_GMM_SWIGLU_QUANT_SCHEMA = ("(Tensor x, Tensor weight, Tensor weight_scale, Tensor x_scale, "
                            "Tensor group_list, *, Tensor? bias=None, Tensor? offset=None, "
                            "float swiglu_limit=0.0) -> (Tensor output, Tensor output_scale, "
                            "Tensor output_offset)")
# vllm-ascend's compiled MoE ops (`torch.ops._C_ascend.*`, vllm_ascend_C; never loaded on a CPU):
# name -> (schema as the newest line's vllm-ascend csrc/torch_binding.cpp declares it, reference
# body).
# `register_cpu_ops()` defines each one that does not exist and gives it a CPU kernel.
_ASCEND_C_OPS = {
    "moe_gating_top_k": (
        "(Tensor x, int k, int k_group, int group_count, int group_select_mode, int renorm, "
        "int norm_type, bool out_flag, float routed_scaling_factor, float eps, "
        "Tensor? bias_opt=None) -> (Tensor y, Tensor expert_idx, Tensor out)", _gating_top_k),
    "npu_moe_init_routing_custom": (
        "(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
        "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)",
        _init_routing_custom),
    "grouped_matmul_swiglu_quant": (_GMM_SWIGLU_QUANT_SCHEMA,
                                    moe_reference.grouped_matmul_swiglu_quant),
    # the NZ-weight variant: same values (the emulated NZ cast never changes a tensor's bytes);
    # its weight must be FRACTAL_NZ
    "grouped_matmul_swiglu_quant_weight_nz": (_GMM_SWIGLU_QUANT_SCHEMA,
                                              moe_reference.grouped_matmul_swiglu_quant_weight_nz),
    "npu_dequant_swiglu_quant": (
        "(Tensor x, *, Tensor? weight_scale=None, Tensor? activation_scale=None, "
        "Tensor? bias=None, Tensor? quant_scale=None, Tensor? quant_offset=None, "
        "Tensor? group_index=None, bool activate_left=True, int quant_mode=0, "
        "int swiglu_mode=0, float clamp_limit=0.0, float glu_alpha=1.0, float glu_bias=0.0) "
        "-> (Tensor y, Tensor scale)", _dequant_swiglu_quant),
}
ASCEND_C_NAMESPACE = "_C_ascend"


def _op_exists(ns: str, name: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel(f"{ns}::{name}") or \
            bool(torch._C._dispatch_find_schema_or_throw(f"{ns}::{name}", ""))
    except RuntimeError:
        return False


def register_cpu_ops() -> List[str]:
    """Give the NPU-only custom ops that exist in this process a CPU kernel, and define
    vllm-ascend's compiled MoE ops (`_ASCEND_C_OPS`) with their reference bodies (idempotent;
    call after vllm-ascend registered its ops). Returns the qualified names registered now."""
    done = []
    for (ns, name), fn in _CUSTOM_OPS.items():
        qual = f"{ns}::{name}"
        if qual in _cpu_libs or not hasattr(getattr(torch.ops, ns), name):
            continue
        lib = torch.library.Library(ns, "IMPL")
        lib.impl(name, fn, "CPU")
        _cpu_libs[qual] = lib  # the registration lives as long as the Library object
        done.append(qual)
    ns = ASCEND_C_NAMESPACE
    for name, (schema, fn) in _ASCEND_C_OPS.items():
        qual = f"{ns}::{name}"
        if qual in _cpu_libs:
            continue
        if _op_exists(ns, name):
            # defined by a loaded vllm_ascend_C: give it a CPU kernel only
            lib = torch.library.Library(ns, "IMPL")
        else:
            lib = torch.library.Library(ns, "FRAGMENT")
            lib.define(name + schema)
        lib.impl(name, fn, "CPU")
        _cpu_libs[qual] = lib
        done.append(qual)
    return done


class RealTorchNpuPresent(NpuFlashrlError, RuntimeError):
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


class _CompletedEvent:
    """An NPU event on the emulated machine: the CPU runs every op in order, so an event is
    complete when it is recorded, and waiting for it is a no-op."""

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _InOrderStream:
    """The current NPU stream on the emulated machine: one in-order stream (the CPU's), so the
    events vllm-ascend's fused-MoE layers record around dispatch / gmm / combine are complete
    when recorded and stream waits are no-ops."""

    def record_event(self, event=None):
        return event if event is not None else _CompletedEvent()

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


_STREAM = _InOrderStream()


class _NpuNamespace(_EmulatedModule):
    """`torch.npu` / `torch_npu.npu`: no device is available on an emulated machine; the current
    stream is the CPU's in-order one (`_InOrderStream`)."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def current_stream(device=None) -> _InOrderStream:
        return _STREAM

    # --- device queries (issue 43): what torch_npu answers on a host without a visible NPU ---
    @staticmethod
    def get_device_capability(device=None):
        """torch_npu: a reserved interface returning None by default (hiascend.com PyTorch API list,
        ptaoplist_000247: "预留接口,暂不支持,接口默认返回None"); with TORCH_NPU_DEVICE_CAPABILITY
        set ("major.minor", e.g. 8.0) it returns that pair (Ascend/pytorch docs,
        environment_variable_reference/TORCH_NPU_DEVICE_CAPABILITY.md)."""
        return _device_capability_from_env()

    @staticmethod
    def is_initialized() -> bool:
        return False  # no device was ever initialised on an emulated machine

    @staticmethod
    def current_device() -> torch.device:
        """The device tensors meant for "the current NPU" go to on the emulated machine: the
        CPU (the quant_config-layout lines' all-to-all dispatcher allocates its expert map there
        at build)."""
        return torch.device("cpu")


CAPABILITY_ENV = "TORCH_NPU_DEVICE_CAPABILITY"


def _device_capability_from_env():
    value = os.environ.get(CAPABILITY_ENV, "").strip()
    if not value:
        return None
    major, dot, minor = value.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"{CAPABILITY_ENV}={value!r}: expected major.minor, e.g. 8.0 (as torch_npu "
                         "reads it)")
    return int(major), int(minor)


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
    def __init__(self):
        self.packages = set(DEFAULT_PACKAGES)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


_FINDER = _Finder()


def _tensor_npu(self, device=None, non_blocking=False, **kwargs):
    """`Tensor.npu()` on the emulated machine (real torch_npu adds the method): "the NPU" is the
    CPU (`torch.npu.current_device()`), so the tensor itself. vllm-ascend's W4A8_DYNAMIC
    post-processing moves the scales it derives with it."""
    return self


def _install_tensor_npu() -> None:
    if not hasattr(torch.Tensor, "npu"):
        torch.Tensor.npu = _tensor_npu


def real_torch_npu_importable() -> bool:
    """True when a real torch_npu (not ours) could be imported in this process."""
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        # ours, or another stand-in put there by hand (vllm-ascend's tests/ut/conftest.py puts a
        # bare module without a file): not a real package
        return not getattr(mod, "__npu_flashrl_emulated__", False) and \
            getattr(mod, "__file__", None) is not None
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


def install(packages=DEFAULT_PACKAGES) -> None:
    """Install the emulation of `packages` (names from EMULATED_PACKAGES; idempotent, a second
    call adds packages). Raises RealTorchNpuPresent over a real torch_npu.

    A torch_npu stand-in already in `sys.modules` (vllm-ascend's own UT conftest installs one
    before any test imports) is kept: the emulation then answers only the modules it leaves out."""
    unknown = sorted(set(packages) - set(EMULATED_PACKAGES))
    if unknown or "torch_npu" not in packages:
        raise ValueError(f"emulation.install(packages={tuple(packages)!r}): expected torch_npu and "
                         f"optionally torchair (emulated: {', '.join(EMULATED_PACKAGES)})")
    if is_installed():
        _FINDER.packages.update(packages)
        return
    if real_torch_npu_importable():
        raise RealTorchNpuPresent(
            "a real torch_npu is importable in this environment; npu_flashrl will not emulate it. "
            "Use the real NPU kernels, or run the CPU tests in a venv without torch_npu "
            "(scripts/bootstrap_cpu_stack.sh).")
    _FINDER.packages = set(packages)
    sys.meta_path.insert(0, _FINDER)
    importlib.import_module("torch_npu")
    _install_tensor_npu()


def uninstall() -> None:
    """Remove the finder and the emulated modules (for tests)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER.packages = set(DEFAULT_PACKAGES)
    for name in list(sys.modules):
        if name.split(".", 1)[0] in EMULATED_PACKAGES and getattr(sys.modules[name], "__npu_flashrl_emulated__", False):
            del sys.modules[name]
    if isinstance(getattr(torch, "npu", None), _NpuNamespace):
        del torch.npu
    if getattr(torch.Tensor, "npu", None) is _tensor_npu:
        del torch.Tensor.npu
