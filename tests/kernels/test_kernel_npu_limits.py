"""kernels/npu.py (the torch_npu weight quantizer) stays within npu_dynamic_quant's documented
row-length limit of older releases (11264 values on Atlas A2 up to Ascend Extension for PyTorch
6.0.RC3): longer rows (Qwen2.5-7B's down_proj: 18944) are quantized with npu_quantize instead,
bit-identical to the reference.

Stand-ins: the emulated torch_npu (no NPU here), its npu_dynamic_quant wrapped to refuse a row
longer than the old limit, as such a release does."""
import pytest
import torch

from npu_flashrl.kernels import emulation, op_rules, reference


@pytest.fixture
def old_release(monkeypatch):
    was = emulation.is_installed()
    emulation.install()
    import torch_npu

    real = torch_npu.npu_dynamic_quant
    calls = []

    def limited(x, *a, **kw):
        calls.append(tuple(x.shape))
        if x.shape[-1] > op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3:
            raise RuntimeError("EZ9999: x's last dim exceeds 11264")
        return real(x, *a, **kw)

    monkeypatch.setattr(torch_npu, "npu_dynamic_quant", limited)
    yield calls
    if not was:
        emulation.uninstall()


@pytest.mark.parametrize("transposed", [False, True])
def test_long_rows_take_npu_quantize_and_match_the_reference(old_release, transposed):
    from npu_flashrl.kernels import npu

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 18944, generator=g) * 0.02).to(torch.bfloat16)  # Qwen2.5-7B down_proj rows
    w[3] = 0  # an all-zero row: scale 1.0, as the reference defines
    assert npu.device_facts(w.device)["long_rows"] is False  # the probe met the old release's refusal
    old_release.clear()
    q, s = npu.quantize_weight_per_channel(w, transposed=transposed)
    q_ref, s_ref = reference.quantize_weight_per_channel(w)
    assert old_release == []  # npu_dynamic_quant was not called with the long rows
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and float(s[3]) == 1.0
    if transposed:  # the processed [in, out] memory layout
        assert q.t().is_contiguous()
    else:
        assert q.is_contiguous()


def test_rows_within_the_limit_still_use_npu_dynamic_quant(old_release):
    from npu_flashrl.kernels import npu

    w = (torch.randn(4, op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3) * 0.02).to(torch.bfloat16)
    npu.device_facts(w.device)
    old_release.clear()
    q, s = npu.quantize_weight_per_channel(w)
    assert old_release == [(4, op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3)]
    q_ref, s_ref = reference.quantize_weight_per_channel(w)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_a_release_that_takes_long_rows_quantizes_them_in_one_op():
    """The emulation follows the current page (no row limit): the probe finds it, and down_proj's
    rows go through npu_dynamic_quant, bit-identical to the reference."""
    from npu_flashrl.kernels import npu

    was = emulation.is_installed()
    emulation.install()
    try:
        import torch_npu

        w = (torch.randn(3, 18944) * 0.02).to(torch.bfloat16)
        assert npu.device_facts(w.device) == {"nonfinite_in_scale": True, "long_rows": True}
        calls = []
        real = torch_npu.npu_dynamic_quant
        torch_npu.npu_dynamic_quant = lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k)
        try:
            assert npu.device_facts(w.device)["long_rows"] is True  # probed through the wrapper
            calls.clear()
            q, s = npu.quantize_weight_per_channel(w)
        finally:
            torch_npu.npu_dynamic_quant = real
        assert calls == [(3, 18944)]
        q_ref, s_ref = reference.quantize_weight_per_channel(w)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    finally:
        if not was:
            emulation.uninstall()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_refused_whether_or_not_the_op_carries_it_into_the_scale(monkeypatch, bad):
    """Where npu_dynamic_quant's row max drops a NaN (a stand-in op whose scale ignores NaN / Inf:
    the page is silent on it), the probe says so and the all-finite pass stays; where it carries
    it, the scales are checked instead. Either way a non-finite weight is refused."""
    from npu_flashrl.kernels import npu

    was = emulation.is_installed()
    emulation.install()
    try:
        import torch_npu

        real = torch_npu.npu_dynamic_quant

        def drops_nonfinite(x, *a, **kw):
            q, scale = real(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), *a, **kw)
            return q, scale

        w = (torch.randn(4, 64) * 0.02).to(torch.bfloat16)
        w[2, 5] = bad
        for op, carries in ((real, True), (drops_nonfinite, False)):
            monkeypatch.setattr(torch_npu, "npu_dynamic_quant", op)
            assert npu.device_facts(w.device)["nonfinite_in_scale"] is carries
            with pytest.raises(ValueError, match="NaN or Inf"):
                npu.quantize_weight_per_channel(w)
    finally:
        if not was:
            emulation.uninstall()
