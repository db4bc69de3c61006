"""The per-channel quantizer (`kernels.reference._per_channel_strips`) in few whole-tensor
operations: bit-identical to the strip-by-strip kernel it replaced (kept here as the oracle) on
random and tie-heavy inputs, in both layouts and over several chunks, and its operator count is
set by the chunk count, not the row count."""
import pytest
import torch

from npu_flashrl.kernels import reference as ref
from npu_flashrl.sim.costs import CostCounter
from test_kernels import _tie_heavy_weight


def _strips_before(weight, transposed, block_elems=1 << 18):
    """The previous kernel, one row strip of ~`block_elems` fp32 at a time (twelve operations per
    strip), verbatim but for the strip size parameter."""
    rows, cols = weight.shape
    step = min(max(rows, 1), max(64 if transposed else 8, block_elems // max(cols, 1)))
    buf = torch.empty((step, cols), dtype=torch.float32)
    hi = torch.empty(step, dtype=torch.float32)
    lo = torch.empty(step, dtype=torch.float32)
    absmax = torch.empty(rows, dtype=torch.float32)
    scale = torch.empty(rows, dtype=torch.float32)
    out = torch.empty((cols, rows) if transposed else (rows, cols), dtype=torch.int8)
    strip8 = torch.empty((step, cols), dtype=torch.int8)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = r1 - r0
        b = buf[:n]
        b.copy_(weight[r0:r1])
        torch.amax(b, dim=1, out=hi[:n])
        torch.amin(b, dim=1, out=lo[:n])
        a = torch.maximum(hi[:n], lo[:n].neg_(), out=absmax[r0:r1])
        s = torch.where(a > 1e-30, a / 127, 1.0)
        scale[r0:r1] = s
        b.div_(s[:, None]).round_()
        if transposed:
            t = strip8[:n]
            t.copy_(b)
            out[:, r0:r1].copy_(t.t())
        else:
            out[r0:r1].copy_(b)
    return (out.t() if transposed else out), absmax, scale


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_blocks", [1, 64], ids=["many-chunks", "one-chunk"])
def test_chunked_kernel_equals_strip_kernel_bit_for_bit(monkeypatch, transposed, dtype, chunk_blocks):
    monkeypatch.setattr(ref, "_BLOCK_ELEMS", 1024)
    monkeypatch.setattr(ref, "_CHUNK_BLOCKS", chunk_blocks)
    g = torch.Generator().manual_seed(11)
    ties = _tie_heavy_weight(301, 96, dtype, seed=5)
    for w in (ties, (torch.randn(257, 130, generator=g) * torch.rand(257, 1, generator=g)).to(dtype)):
        q, a, s = ref._per_channel_strips(w, transposed)
        q0, a0, s0 = _strips_before(w, transposed, block_elems=256)
        assert torch.equal(a, a0) and torch.equal(s, s0) and a.dtype == s.dtype == torch.float32
        assert torch.equal(q, q0) and q.dtype == torch.int8
        assert q.t().is_contiguous() if transposed else q.is_contiguous()
    _, _, s_ties = _strips_before(ties, transposed)
    assert ((ties.float()[1::3] / s_ties[1::3, None]).frac().abs() == 0.5).any()  # exact ties ran
    if chunk_blocks == 1:  # several chunks, the last one ragged
        assert ref._strip_rows(96) < 301 and 301 % ref._strip_rows(96) != 0


@pytest.mark.parametrize("transposed", [False, True])
def test_operator_count_follows_chunks_not_rows(transposed):
    """Four times the rows under one chunk add no operator; the operators per chunk are three
    (division, rounding, the int8 write)."""
    def launches(rows, cols=256):
        w = torch.randn(rows, cols).to(torch.bfloat16)
        with CostCounter() as c:
            ref._per_channel_strips(w, transposed)
        return c.costs.launches

    small, large = launches(64), launches(256)
    assert small == large <= 12  # the row extremes and scales: a few vector operations
    step = ref._strip_rows(256)
    assert launches(3 * step) - launches(step) == 2 * 3
