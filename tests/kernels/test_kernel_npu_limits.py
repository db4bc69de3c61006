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
    q, s = npu.quantize_weight_per_channel(w)
    assert old_release == [(4, op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3)]
    q_ref, s_ref = reference.quantize_weight_per_channel(w)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
