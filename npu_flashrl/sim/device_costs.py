"""Sync costs in the NPU's own units: what each operation the sync runs would cost as NPU kernels
(benchmark and test tooling, beside `costs.CostCounter`'s CPU counts).

`DeviceCounter` is a `CostCounter` that counts at the level of the device's kernels, not of the
CPU reference's:

- **The quantizer takes the NPU path.** While counting, `npu_flashrl.kernels` dispatches as it
  does for a tensor on an NPU (`kernels/npu.py`: the all-finite pass, `npu_dynamic_quant`, the
  transposing copy; rows past npu_dynamic_quant's A2 limit: amax, amin, `npu_quantize`), on the
  emulated torch_npu. The CPU reference's 1M-element chunks (one device kernel each would be a
  launch per chunk) are not run at all.
- **An emulated torch_npu op is one kernel**: one launch, the stored bytes of its tensor inputs
  read and of its tensor outputs written (its documented inputs and outputs, `kernels/op_rules`),
  its outputs allocated; the CPU arithmetic inside the emulation is not counted. A format cast
  to the format a tensor already has returns it unchanged and costs nothing.
- **aten operators are counted once each**, as `CostCounter` does (a device runs each as one
  kernel); `torch.isfinite`, which the CPU build decomposes into four, is one.
- **Host synchronisations** (`host_syncs`): `item()` / `bool(tensor)` / `float(tensor)`
  (`_local_scalar_dense`, `is_nonzero`), `equal`, `nonzero` (its output size is read back),
  `.tolist()`, `.numpy()` and `.cpu()` of a device tensor; the bytes they bring back are
  `device_to_host_bytes`.
- **Host-to-device copies** (`host_to_device_bytes`): a tensor whose storage is host memory
  (`mark_host`: verl's shared-memory bucket) moved with `.to(device)` is
  copied (one launch, its bytes written into device memory and allocated there for as long as the
  copy lives), which on the CPU would be a no-op returning the same tensor.
- **Transport copies** on the device (`device_copy`): what a benchmark's stand-in for a transport
  does on the device (verl's copy out of a checkpoint engine's bucket) counted as such, and
  `device_write` for what a collective writes into device memory.
- **Other threads are covered**: a thread started while counting runs under the same counter
  (torch's dispatch-mode stack is thread local, so its work would otherwise be invisible).
  Threads started before counting are not covered; a benchmark must not hand torch work to one.

Every figure is a count, not a time; `estimate_seconds` turns counts into an estimate from the
bandwidth and launch cost it is given.

Runtime code never imports this module (CPU-simulation tooling).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import _pop_mode, _push_mode

from npu_flashrl.sim.costs import Costs, CostCounter, _tensors, stored_bytes

aten = torch.ops.aten

# aten operators that launch a kernel AND read a result back to the host before they return
_SYNCING_KERNELS = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
                    aten._unique2.default}
# emulated torch_npu ops that only read metadata (no kernel)
_NPU_METADATA_OPS = {"get_npu_format", "npu_format_cast_"}
# torch functions one device kernel runs, which the CPU build decomposes (CompositeImplicit)
_ONE_KERNEL_TORCH_FNS = ("isfinite",)

_active: Optional["DeviceCounter"] = None
_MISSING = object()


def active() -> Optional["DeviceCounter"]:
    """The DeviceCounter counting right now in this process, or None."""
    return _active


@dataclass
class DeviceCosts(Costs):
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(host_to_device_bytes=self.host_to_device_bytes,
                 device_to_host_bytes=self.device_to_host_bytes)
        return d

    def __add__(self, other: "Costs") -> "DeviceCosts":
        base = Costs.__add__(self, other)
        return DeviceCosts(**{**base.__dict__,
                              "host_to_device_bytes": self.host_to_device_bytes
                              + getattr(other, "host_to_device_bytes", 0),
                              "device_to_host_bytes": self.device_to_host_bytes
                              + getattr(other, "device_to_host_bytes", 0)})


def _device_arg(args, kwargs) -> bool:
    """`Tensor.to(...)` names a device (not only a dtype)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in args[:1])


class DeviceCounter(CostCounter):
    """`with DeviceCounter() as c: ...` then `c.costs` (a `DeviceCosts`; see the module doc)."""

    def __init__(self):
        super().__init__()
        self.costs = DeviceCosts()
        self._host = weakref.WeakKeyDictionary()  # storages in host memory
        self._lock = threading.RLock()
        self._undo = []

    # ------------------------------------------------------------------ what the caller tells
    def mark_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s storage is host memory (a shared-memory bucket): moving it to the device is a
        host-to-device copy, its `.cpu()` is free."""
        self._host[t.untyped_storage()] = True
        return t

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage() in self._host

    def device_copy(self, src: torch.Tensor, op: str = "transport_copy") -> torch.Tensor:
        """A copy of `src` made on the device (one launch, read and written, allocated)."""
        with self.paused():
            out = src.clone()
        self._kernel(op, [src], [out])
        return out

    def device_write(self, nbytes: int, op: str = "collective_recv", launches: int = 1) -> None:
        """Bytes a collective (a broadcast into a bucket) writes into device memory."""
        with self._lock:
            self.costs.launches += launches
            self.costs.by_op[op] += launches
            self.costs.written_bytes += nbytes
            self.costs.bytes_by_op[op] += nbytes

    # ------------------------------------------------------------------ counting
    def _kernel(self, op: str, inputs, outputs) -> None:
        with self._lock:
            c = self.costs
            c.launches += 1
            c.by_op[op] += 1
            r = sum(stored_bytes(t) for t in inputs)
            w = sum(stored_bytes(t) for t in outputs)
            c.read_bytes += r
            c.written_bytes += w
            c.bytes_by_op[op] += r + w
            self._track_new(outputs, inputs)

    def _sync(self, t: Optional[torch.Tensor] = None) -> None:
        with self._lock:
            self.costs.host_syncs += 1
            if t is not None and t.device.type != "meta":
                self.costs.device_to_host_bytes += stored_bytes(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self._lock:
            if not self._paused and func in _SYNCING_KERNELS:
                self.costs.host_syncs += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    # ------------------------------------------------------------------ the patches
    def _patch(self, owner, name, new) -> None:
        # a class attribute may be inherited (Tensor.to lives on torch._C.TensorBase): undone by
        # deleting the override, not by setting the inherited one on the subclass
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
        self._undo.append((owner, name, old))
        setattr(owner, name, new)

    def _npu_op(self, name, fn):
        counter = self

        def op(*args, **kwargs):
            with counter.paused():
                out = fn(*args, **kwargs)
            if counter._paused:
                return out
            inputs = list(_tensors(list(args) + list(kwargs.values())))
            outs = list(_tensors(out))
            if any(o is i for o in outs for i in inputs):  # a cast to its own format: nothing
                return out
            counter._kernel(name, inputs, outs)
            return out

        op.__wrapped__ = fn
        return op

    def _install(self) -> None:
        import sys

        from npu_flashrl import kernels

        # the quantizer as on an NPU: kernels/npu.py over the emulated torch_npu
        self._patch(kernels, "backend_for",
                    lambda t: "npu" if t.device.type != "meta" else "reference")
        npu = sys.modules.get("torch_npu")
        if npu is None or not getattr(npu, "__npu_flashrl_emulated__", False):
            raise RuntimeError("DeviceCounter: the torch_npu emulation is not installed "
                               "(npu_flashrl.kernels.emulation.install(), or "
                               "sim.cpu_vllm.prepare_process()); the device kernel mix runs on it")
        from npu_flashrl.kernels import emulation

        for name in emulation._TORCH_NPU_OPS:
            if name not in _NPU_METADATA_OPS:
                self._patch(npu, name, self._npu_op(name, getattr(npu, name)))
        # one device kernel each (aclnnIsFinite), which torch decomposes into four on the CPU
        for name in _ONE_KERNEL_TORCH_FNS:
            self._patch(torch, name, self._npu_op(name, getattr(torch, name)))
        counter = self
        tensor_to, tensor_cpu = torch.Tensor.to, torch.Tensor.cpu
        tensor_numpy, tensor_tolist = torch.Tensor.numpy, torch.Tensor.tolist

        def to(t, *args, **kwargs):
            if counter._paused or not counter.is_host(t) or not _device_arg(args, kwargs):
                return tensor_to(t, *args, **kwargs)
            with counter.paused():
                rest = tensor_to(t, *args, **kwargs)
                if rest.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                    rest = t.clone()  # the device's own copy (the CPU's `to` returns `t`)
            counter._kernel("h2d_copy", [], [rest])
            with counter._lock:
                counter.costs.host_to_device_bytes += stored_bytes(t)
            return rest

        def to_host(orig):
            def f(t, *args, **kwargs):
                if not counter._paused and not counter.is_host(t):
                    counter._sync(t)
                return orig(t, *args, **kwargs)
            return f

        self._patch(torch.Tensor, "to", to)
        self._patch(torch.Tensor, "cpu", to_host(tensor_cpu))
        self._patch(torch.Tensor, "numpy", to_host(tensor_numpy))
        self._patch(torch.Tensor, "tolist", to_host(tensor_tolist))
        # threads started while counting run under this counter
        start = threading.Thread.start

        def started(thread, *a, **k):
            run = thread.run

            def covered():
                _push_mode(counter)
                try:
                    run()
                finally:
                    _pop_mode()
            thread.run = covered
            return start(thread, *a, **k)

        self._patch(threading.Thread, "start", started)

    def _uninstall(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def __enter__(self):
        global _active
        if _active is not None:
            raise RuntimeError("DeviceCounter: another DeviceCounter is counting in this process")
        self._install()
        _active = self
        try:
            out = super().__enter__()
            from npu_flashrl.kernels import npu

            with self.paused():  # the once-per-process probes of the device's op semantics
                npu.device_facts(torch.device("cpu"))
            return out
        except BaseException:
            _active = None
            self._uninstall()
            raise

    def __exit__(self, *exc):
        global _active
        try:
            return super().__exit__(*exc)
        finally:
            _active = None
            self._uninstall()


@contextlib.contextmanager
def counting_on_device():
    """`with counting_on_device() as c:` -> `c.costs` (a `DeviceCosts`) after the block."""
    with DeviceCounter() as c:
        yield c


# --------------------------------------------------------------------------- estimates

@dataclass(frozen=True)
class DeviceSpec:
    """What an estimate assumes of a device (named and cited where it is used)."""

    name: str
    hbm_bytes_per_s: float
    launch_s: float
    host_sync_s: float


def estimate_seconds(costs: Costs, spec: DeviceSpec) -> dict:
    """An ESTIMATE of device time from counts: HBM traffic at the peak bandwidth, every launch
    and host synchronisation at the assumed cost (a lower bound on traffic time, no overlap
    assumed between them)."""
    traffic = costs.traffic_bytes / spec.hbm_bytes_per_s
    launches = costs.launches * spec.launch_s
    syncs = costs.host_syncs * spec.host_sync_s
    return {"hbm_s": traffic, "launch_s": launches, "sync_s": syncs,
            "total_s": traffic + launches + syncs}


def by_op_summary(costs: Costs, top: int = 8) -> str:
    """`op xN (MB)` of the ops with the most bytes, for a printed breakdown."""
    ops = collections.Counter(costs.bytes_by_op).most_common(top)
    return ", ".join(f"{op} x{costs.by_op[op]} ({b / 2**20:.1f} MB)" for op, b in ops)
