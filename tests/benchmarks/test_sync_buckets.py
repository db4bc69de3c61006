"""`benchmarks/sync.py`'s `rollout_buckets`: the checkpoint engine's tensors as verl 0.9.1's
rollout-side `CheckpointEngineWorker` hands them on (its `ServerAdapter`'s `BucketedWeightSender`
packing, one `load_weights` list call per bucket), and what it charges the device: HCCL's write
into the engine's bucket, one copy per tensor into the rollout's IPC bucket, a tensor larger
than a bucket re-assembled (a copy) and sent alone. `test_benchmark_sync` holds the packing
against verl's real sender on a model; this holds the edge cases.

Stand-ins: plain CPU tensors for the engine's views of its device bucket; the emulated torch_npu
(no NPU here) under `DeviceCounter`."""
import os
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture
def sync_bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import sync
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    return sync


@pytest.fixture
def emulated_torch_npu():
    from npu_flashrl.kernels import emulation

    was = emulation.is_installed()
    emulation.install()
    yield
    if not was:
        emulation.uninstall()


def _items():
    return [("a", torch.ones(600, dtype=torch.int8)),
            ("s", torch.ones(2, dtype=torch.float32)),    # 600 -> aligned to 600, fits: 608
            ("b", torch.ones(500, dtype=torch.int8)),     # 608 + 500 > 1024: a new bucket
            ("big", torch.ones(1500, dtype=torch.bfloat16)),  # 3000 B > 1024: alone
            ("c", torch.ones(3, dtype=torch.int8)),
            ("f", torch.ones(255, dtype=torch.float32))]  # 3 -> aligned to 4, 4 + 1020 = 1024 fits


def test_packing_follows_verls_sender(sync_bench):
    buckets = list(sync_bench.rollout_buckets(iter(_items()), 1024))
    assert [[n for n, _ in b] for b in buckets] == [["a", "s"], ["b"], ["big"], ["c", "f"]]
    # copies, not the engine's views (the engine refills its bucket for the next broadcast)
    src = dict(_items())
    for b in buckets:
        for name, t in b:
            assert torch.equal(t, src[name])


def test_device_counts_charge_the_transport(sync_bench, emulated_torch_npu):
    from npu_flashrl.sim.device_costs import DeviceCounter

    items = _items()
    nbytes = {n: t.numel() * t.element_size() for n, t in items}
    with DeviceCounter() as c:
        got = [[n for n, _ in b] for b in sync_bench.rollout_buckets(iter(items), 1024, c)]
    assert got == [["a", "s"], ["b"], ["big"], ["c", "f"]]
    costs = c.costs
    assert costs.bytes_by_op["hccl_broadcast"] == sum(nbytes.values())
    assert costs.by_op["hccl_broadcast"] == 0  # HCCL's, no kernel per tensor
    small = sum(v for n, v in nbytes.items() if n != "big")
    assert costs.bytes_by_op["ce_bucket_copy"] == 2 * small and costs.by_op["ce_bucket_copy"] == 5
    assert costs.bytes_by_op["ce_merge_copy"] == 2 * nbytes["big"] and costs.by_op["ce_merge_copy"] == 1
    transport = sync_bench.transport_bytes({"bytes_by_op": dict(costs.bytes_by_op)}, "ce")
    assert transport == costs.traffic_bytes == 3 * sum(nbytes.values())
