"""`npu_flashrl.sim.device_costs.DeviceCounter`: counts in the NPU's units, held at tiny shapes.

Stand-ins: the emulated torch_npu (no NPU here) runs `kernels/npu.py`'s kernel mix; the CPU plays
the device's memory (a host-marked tensor is the host's)."""
import threading

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.sim.costs import CostCounter
from npu_flashrl.sim.device_costs import DeviceCounter, DeviceSpec, active, estimate_seconds


@pytest.fixture
def emulated_torch_npu():
    from npu_flashrl.kernels import emulation

    was = emulation.is_installed()
    emulation.install()
    yield
    if not was:
        emulation.uninstall()


def _w(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(torch.bfloat16)


def test_quantizer_is_one_kernel_mix_whatever_the_cpu_chunks(emulated_torch_npu):
    """The per-channel quantizer costs what kernels/npu.py launches on an NPU whose
    npu_dynamic_quant carries NaN / Inf into its scales (the emulation's, `npu.device_facts`):
    one npu_dynamic_quant, the scale check (1 host sync), no all-finite pass over the weight,
    no transposing copy; the same launches for a weight the CPU reference runs in one chunk and
    one it runs in 4."""
    small, big = _w(64, 128), _w(4096, 1024)
    counts = {}
    for name, w in (("small", small), ("big", big)):
        with DeviceCounter() as c:
            q, s = kernels.quantize_weight_per_channel(w, torch.bfloat16, transposed=True)
        counts[name] = c.costs
        ref_q, ref_s = kernels.quantize_weight_per_channel(w, torch.bfloat16, transposed=True)
        assert torch.equal(q, ref_q) and torch.equal(s, ref_s)  # same values as the reference
    with CostCounter() as cpu:
        kernels.quantize_weight_per_channel(big, torch.bfloat16, transposed=True)
    assert cpu.costs.by_op["round_"] == 4  # the CPU reference: 4 chunks
    small_c, big_c = counts["small"], counts["big"]
    assert small_c.launches == big_c.launches and big_c.by_op["npu_dynamic_quant"] == 1
    assert "round_" not in big_c.by_op and big_c.host_syncs == 1
    assert "aminmax" not in big_c.by_op and "clone" not in big_c.by_op
    n = big.numel()
    # the weight read once, its int8 written once, plus a few passes over the 4096 scales
    assert 2 * n <= big_c.read_bytes <= 2 * n + 64 * 4096
    assert n <= big_c.written_bytes <= n + 64 * 4096
    assert big_c.bytes_by_op["npu_dynamic_quant"] == 2 * n + n + 4 * 4096


def test_long_rows_take_one_aminmax_and_npu_quantize_where_the_op_refuses_them(emulated_torch_npu,
                                                                              monkeypatch):
    """Where npu_dynamic_quant refuses rows past 11264 (A2 releases up to 6.0.RC3; a stand-in
    here), long rows cost one aminmax pass (which also refuses NaN) and one npu_quantize."""
    import torch_npu

    from npu_flashrl.kernels import op_rules

    real = torch_npu.npu_dynamic_quant

    def old(x, *a, **kw):
        if x.shape[-1] > op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3:
            raise RuntimeError("x's last dim exceeds 11264")
        return real(x, *a, **kw)

    monkeypatch.setattr(torch_npu, "npu_dynamic_quant", old)
    w = _w(4, 12000)
    with DeviceCounter() as c:
        q, s = kernels.quantize_weight_per_channel(w, torch.bfloat16, transposed=True)
    ops = c.costs.by_op
    assert ops["npu_quantize"] == 1 and ops["aminmax"] == 1 and "amax" not in ops
    assert "npu_dynamic_quant" not in ops and c.costs.host_syncs == 1
    assert torch.equal(q, kernels.quantize_weight_per_channel(w, torch.bfloat16, transposed=True)[0])


def test_host_syncs_and_device_to_host_bytes(emulated_torch_npu):
    x = torch.arange(12, dtype=torch.float32)
    with DeviceCounter() as c:
        x.sum().item()
        x.tolist()
        bool(x.gt(3).any())
        torch.nonzero(x > 5)
        x.numpy()
    assert c.costs.host_syncs == 5
    assert c.costs.device_to_host_bytes == 48 + 48
    assert c.costs.by_op["nonzero"] == 1


def test_host_to_device_copy_is_counted_and_held(emulated_torch_npu):
    """A host (shared-memory) tensor moved to the device: a copy, its bytes written and allocated
    on the device while the copy lives; a device tensor's `.to(device)` stays free."""
    host = torch.ones(256, dtype=torch.bfloat16)
    dev = torch.ones(256, dtype=torch.bfloat16)
    with DeviceCounter() as c:
        c.mark_host(host)
        moved = host.to(torch.device("cpu"))
        same = dev.to(torch.device("cpu"))
        del moved
        again = host.to("cpu")
    assert same is dev and again is not host and torch.equal(again, host)
    costs = c.costs
    assert costs.host_to_device_bytes == 2 * 512 and costs.by_op["h2d_copy"] == 2
    assert costs.written_bytes == 2 * 512 and costs.read_bytes == 0
    assert costs.allocated_bytes == 2 * 512 and costs.peak_extra_bytes == 512


def test_emulated_npu_op_is_one_kernel_and_own_format_cast_is_free(emulated_torch_npu):
    import torch_npu

    w = torch.ones(32, 64, dtype=torch.int8)
    with DeviceCounter() as c:
        nz = torch_npu.npu_format_cast(w, 29)
        torch_npu.npu_format_cast(nz, 29)  # already NZ: returned as it is
    assert c.costs.launches == 1 and c.costs.by_op["npu_format_cast"] == 1
    assert c.costs.read_bytes == c.costs.written_bytes == 2048


def test_work_in_a_thread_started_while_counting_is_covered(emulated_torch_npu):
    x = torch.ones(100)
    with DeviceCounter() as c:
        t = threading.Thread(target=lambda: x.mul(2).sum().item())
        t.start()
        t.join()
    assert c.costs.by_op["mul"] == 1 and c.costs.host_syncs == 1


def test_patches_are_undone_and_one_counter_at_a_time(emulated_torch_npu):
    import torch_npu

    to, quant, backend = torch.Tensor.to, torch_npu.npu_quantize, kernels.backend_for
    with DeviceCounter():
        assert active() is not None and kernels.backend_for(torch.ones(1)) == "npu"
        with pytest.raises(RuntimeError, match="another DeviceCounter"):
            DeviceCounter().__enter__()
    assert active() is None and "to" not in torch.Tensor.__dict__ and torch.Tensor.to is to
    assert torch_npu.npu_quantize is quant and kernels.backend_for is backend
    assert kernels.backend_for(torch.ones(1)) == "reference"


def test_estimate_from_counts():
    from npu_flashrl.sim.device_costs import DeviceCosts

    c = DeviceCosts(launches=10, read_bytes=600, written_bytes=400, host_syncs=2)
    est = estimate_seconds(c, DeviceSpec("x", hbm_bytes_per_s=1000.0, launch_s=0.01, host_sync_s=0.1))
    assert est == pytest.approx({"hbm_s": 1.0, "launch_s": 0.1, "sync_s": 0.2, "total_s": 1.3})
