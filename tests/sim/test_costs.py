"""`npu_flashrl.sim.costs.CostCounter`: launches, bytes read / written, allocations and the
peak extra, hand-computed on small torch programs."""
import torch

from npu_flashrl.sim.costs import CostCounter, stored_bytes


def test_copy_reads_source_writes_destination_allocates_nothing():
    src = torch.ones(64, 32, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    with CostCounter() as c:
        dst.copy_(src)
    assert c.costs.as_dict() == {"launches": 1, "read_bytes": 4096, "written_bytes": 4096,
                                 "traffic_bytes": 8192, "allocated_bytes": 0,
                                 "peak_extra_bytes": 0, "host_syncs": 0}


def test_views_and_empty_are_not_launches_but_empty_allocates():
    x = torch.ones(16, 16)
    with CostCounter() as c:
        v = x[2:5].reshape(-1).t()
        e = torch.empty(10, dtype=torch.int8)
    assert c.costs.launches == 0 and c.costs.traffic_bytes == 0
    assert c.costs.allocated_bytes == 10 and v.numel() == 48 and e.numel() == 10
    with CostCounter() as c:
        x.t().reshape(-1)  # not expressible as a view: a copy
    assert c.costs.launches == 1 and c.costs.allocated_bytes == 1024


def test_peak_extra_follows_frees_and_inplace_reads_self():
    w = torch.ones(256, 64, dtype=torch.bfloat16)  # 32 KB
    with CostCounter() as c:
        x = w.float()          # +64 KB, reads 32 KB
        y = x.mul_(2)          # in place: reads and writes 64 KB, no allocation
        del x
        z = y.t().contiguous()  # +64 KB: 128 KB alive
        del y, z
        a = torch.zeros(256, 64)  # 64 KB again, after the frees: the peak stays 128 KB
    costs = c.costs
    assert costs.launches == 4 and costs.by_op["mul_"] == 1
    assert costs.read_bytes == 32768 + 65536 + 65536
    assert costs.written_bytes == 65536 * 4
    assert costs.allocated_bytes == 65536 * 3
    assert costs.peak_extra_bytes == 131072 and a.sum() == 0


def test_out_argument_is_written_not_read_and_broadcast_counted_once():
    w = torch.ones(128, 64, dtype=torch.bfloat16)
    s = torch.full((128,), 2.0)
    buf = torch.empty(128, 64)
    with CostCounter() as c:
        torch.div(w, s[:, None], out=buf)
        with c.paused():
            buf.clone()
    assert c.costs.launches == 1
    assert c.costs.read_bytes == 128 * 64 * 2 + 128 * 4
    assert c.costs.written_bytes == 128 * 64 * 4 and c.costs.allocated_bytes == 0
    assert stored_bytes(s[:, None].expand(128, 64)) == 512


def test_meta_tensors_count_no_bytes_and_item_is_a_host_sync():
    m = torch.empty(1000, 1000, device="meta")
    with CostCounter() as c:
        m.add_(1)
        torch.ones(3).sum().item()
    assert c.costs.launches == 3 and c.costs.host_syncs == 1
    assert c.costs.read_bytes == 12 and c.costs.written_bytes == 12 + 4


def test_bytes_by_op_add_up_to_the_traffic():
    w = torch.ones(64, 64, dtype=torch.bfloat16)
    with CostCounter() as c:
        x = w.float().mul_(3)
        w.copy_(x)
    costs = c.costs
    assert sum(costs.bytes_by_op.values()) == costs.traffic_bytes
    assert costs.bytes_by_op["copy_"] == 64 * 64 * (4 + 2)
    total = costs + costs
    assert total.traffic_bytes == 2 * costs.traffic_bytes and total.by_op["mul_"] == 2
