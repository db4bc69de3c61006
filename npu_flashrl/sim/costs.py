"""Machine-independent cost counts of torch code run on the CPU (benchmark and test tooling).

`CostCounter` is a `TorchDispatchMode`: every aten operator the code under it dispatches is
counted, so the figures are the same on any machine and carry over to an NPU, where each counted
operator is a kernel launch on the device:

- `launches`: operators that run a kernel. Views (`t`, `slice`, `view`, ...) and bare
  allocations (`empty*`) are metadata on a device too and are not counted; `item()`-style reads
  to the host (`_local_scalar_dense`) are counted apart, as `host_syncs`.
- `read_bytes` / `written_bytes`: the bytes each operator reads from its tensor operands and
  writes to its results, taken from their logical sizes (a broadcast operand counts its stored
  elements once). On an NPU this is HBM traffic; the CPU's caches do not enter the count.
- `allocated_bytes` / `peak_extra_bytes`: the storages operators create while counting, and the
  most of them alive at once (what a device's caching allocator would have to hold on top of the
  memory in use when counting began). Storages are tracked by their Python object, which torch
  keeps for as long as the storage lives, so a freed one leaves the count when torch frees it.
- `by_op` / `bytes_by_op`: launches and bytes read + written per operator name, to see where a
  count comes from.

Meta tensors (vLLM's layerwise reload keeps unloaded layers on the meta device) have no data
and count no bytes. Counting is per thread (torch's dispatch-mode stack is thread local).
`paused()` leaves out work inside it (a stand-in's own copies, a state snapshot).

Runtime code never imports this module (it is CPU-simulation tooling).
"""
from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Allocation without a kernel: a caching allocator hands out memory, nothing runs on the device.
_ALLOC_ONLY = {aten.empty.memory_format, aten.empty.out, aten.empty_strided.default,
               aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default}
# Operators that overwrite `self` without reading it.
_WRITE_ONLY_SELF = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
                    aten.normal_.default, aten.uniform_.default, aten.random_.default,
                    getattr(aten.random_, "from"), aten.random_.to, aten.set_.source_Tensor}
_HOST_SYNC = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
# Pure metadata that returns no view (sizes, shape checks).
_METADATA = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
             aten.sym_storage_offset.default, aten.is_same_size.default,
             aten.is_contiguous.default, aten.is_contiguous.memory_format}


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s distinct elements: a broadcast (stride 0) dimension is stored once."""
    if t.device.type == "meta":
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


# Views whose schema does not say so.
_UNANNOTATED_VIEWS = {aten._unsafe_view.default, aten.lift_fresh.default}


def _is_view(func) -> bool:
    return func in _UNANNOTATED_VIEWS or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _written_args(func):
    """Names of arguments the operator writes (in-place `self`, `out=`)."""
    return {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


@dataclass
class Costs:
    launches: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    allocated_bytes: int = 0
    peak_extra_bytes: int = 0
    host_syncs: int = 0
    by_op: Dict[str, int] = field(default_factory=collections.Counter)
    bytes_by_op: Dict[str, int] = field(default_factory=collections.Counter)

    @property
    def traffic_bytes(self) -> int:
        return self.read_bytes + self.written_bytes

    def as_dict(self) -> dict:
        return {"launches": self.launches, "read_bytes": self.read_bytes,
                "written_bytes": self.written_bytes, "traffic_bytes": self.traffic_bytes,
                "allocated_bytes": self.allocated_bytes, "peak_extra_bytes": self.peak_extra_bytes,
                "host_syncs": self.host_syncs}

    def __add__(self, other: "Costs") -> "Costs":
        by_op = collections.Counter(self.by_op)
        by_op.update(other.by_op)
        bytes_by_op = collections.Counter(self.bytes_by_op)
        bytes_by_op.update(other.bytes_by_op)
        return Costs(self.launches + other.launches, self.read_bytes + other.read_bytes,
                     self.written_bytes + other.written_bytes,
                     self.allocated_bytes + other.allocated_bytes,
                     max(self.peak_extra_bytes, other.peak_extra_bytes),
                     self.host_syncs + other.host_syncs, by_op, bytes_by_op)


class CostCounter(TorchDispatchMode):
    """`with CostCounter() as c: ...` then `c.costs` (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.costs = Costs()
        self._live = 0
        self._tracked: Dict[int, int] = {}  # id(storage object) -> bytes, while it lives
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _freed(self, key: int) -> None:
        self._live -= self._tracked.pop(key, 0)

    def _track_new(self, out, inputs) -> None:
        seen = {id(t.untyped_storage()) for t in inputs if t.device.type != "meta"}
        for t in _tensors(out):
            if t.device.type == "meta":
                continue
            s = t.untyped_storage()
            key = id(s)
            if key in seen or key in self._tracked:
                continue
            seen.add(key)
            n = s.nbytes()
            self._tracked[key] = n
            weakref.finalize(s, self._freed, key)
            self.costs.allocated_bytes += n
            self._live += n
            self.costs.peak_extra_bytes = max(self.costs.peak_extra_bytes, self._live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or func in _METADATA:
            return out
        if func in _HOST_SYNC:
            self.costs.host_syncs += 1
            return out
        inputs = list(_tensors(list(args) + list(kwargs.values())))
        if func in _ALLOC_ONLY:
            self._track_new(out, inputs)
            return out
        if _is_view(func):
            return out
        c = self.costs
        c.launches += 1
        op = func.overloadpacket.__name__
        c.by_op[op] += 1
        before = c.traffic_bytes
        written = _written_args(func)
        names = [a.name for a in func._schema.arguments]
        for i, a in enumerate(args):
            name = names[i] if i < len(names) else None
            if name == "self" and func in _WRITE_ONLY_SELF:
                continue
            if name in written and name != "self":
                continue
            c.read_bytes += sum(stored_bytes(t) for t in _tensors(a))
        for k, v in kwargs.items():
            if k in written:
                continue
            c.read_bytes += sum(stored_bytes(t) for t in _tensors(v))
        c.written_bytes += sum(stored_bytes(t) for t in _tensors(out))
        c.bytes_by_op[op] += c.traffic_bytes - before
        self._track_new(out, inputs)
        return out


@contextlib.contextmanager
def counting():
    """`with counting() as c:` -> `c.costs` after the block."""
    with CostCounter() as c:
        yield c
