"""The torch_npu ops vllm-ascend's W4A8_DYNAMIC fused-MoE layers call beyond the W8A8 ones
(`npu_flashrl.kernels.int4_moe`): npu_quantize to quint4x2 (the experts' packing at load) and the
A8W4 form of npu_grouped_matmul (the forward), each refusing what its page refuses
(`kernels/op_rules.py`), every other call still the W8A8 emulation's.

Stand-in: the emulated torch_npu (the subject here: no NPU in CI)."""
import pytest
import torch

from npu_flashrl.kernels import emulation, int4, int4_moe, moe_reference, op_rules

from helpers import emulated_torch_npu

pytestmark = pytest.mark.every_line


@pytest.fixture
def torch_npu():
    with emulated_torch_npu() as mod:
        yield mod


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_emulated_ops_are_the_int4_moe_kernels(torch_npu):
    assert torch_npu.npu_quantize is int4_moe.npu_quantize
    assert torch_npu.npu_grouped_matmul is int4_moe.npu_grouped_matmul


def test_quint4x2_packs_eight_values_per_int32_along_the_last_dim(torch_npu):
    """vllm-ascend's call on the transposed experts: fp32 int4 values, scale 1.0, axis -1."""
    w = torch.randint(-8, 8, (3, 16, 24), generator=_g(0), dtype=torch.int8)
    packed = torch_npu.npu_quantize(w.float(), torch.tensor([1.0]), None, torch.quint4x2, -1, False)
    assert packed.dtype == torch.int32 and packed.shape == (3, 16, 3)
    assert torch.equal(int4.unpack_int4(packed), w)
    # element 8j+i sits in bits 4i..4i+3 of word j, as npu_convert_weight_to_int4pack's emulation
    assert torch.equal(packed[0], int4.npu_convert_weight_to_int4pack(w[0].to(torch.int32).contiguous()))


def test_quint4x2_scales_rounds_half_to_even_and_saturates(torch_npu):
    x = torch.tensor([[0.5, 1.5, 2.5, -2.5, 3.0, 9.0, -9.0, 0.0]])
    packed = torch_npu.npu_quantize(x, torch.tensor([1.0]), None, torch.quint4x2, -1, False)
    assert int4.unpack_int4(packed).tolist() == [[0, 2, 2, -2, 3, 7, -8, 0]]
    packed = torch_npu.npu_quantize(x, torch.tensor([2.0]), None, torch.quint4x2, -1, False)
    assert int4.unpack_int4(packed).tolist() == [[1, 3, 5, -5, 6, 7, -8, 0]]


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2, 12), torch.tensor([1.0]), None, torch.quint4x2, -1, False), "multiple of 8"),
    ((torch.zeros(2, 8), torch.tensor([1.0]), None, torch.quint4x2, -1, True), "qint8, torch.quint8"),
    ((torch.zeros(2, 8), torch.tensor([1.0]), None, torch.quint4x2, -3, False), "axis"),
])
def test_quint4x2_refusals(torch_npu, args, match):
    with pytest.raises(op_rules.OpRuleError, match=match) as e:
        torch_npu.npu_quantize(*args)
    assert "npu_quantize" in str(e.value) and "gitcode.com" in str(e.value)


def test_qint8_quantize_is_still_the_w8a8_kernel(torch_npu):
    x = torch.randn(4, 8, generator=_g(1))
    s = torch.full((8,), 20.0)
    assert torch.equal(torch_npu.npu_quantize(x, s, None, torch.qint8, -1, False),
                       __import__("npu_flashrl.kernels.reference", fromlist=["x"]).npu_quantize(
                           x, s, None, torch.qint8, -1, False))


E, K, N, M = 3, 512, 24, 7


def _a8w4_inputs(bias_ok=True, seed=2):
    x = torch.randint(-128, 128, (M, K), generator=_g(seed), dtype=torch.int8)
    w = torch.randint(-8, 8, (E, K, N), generator=_g(seed + 1), dtype=torch.int8)
    s = (torch.rand(E, K // 256, N, generator=_g(seed + 2)) * 0.01).half().float()
    bias = 8 * (w.double() * s.double().repeat_interleave(256, dim=1)).sum(dim=1)
    if not bias_ok:
        bias = bias * 0.5
    packed = torch.stack([int4.pack_int4(w[i]) for i in range(E)])
    scale = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    pts = torch.rand(M, generator=_g(seed + 3)) * 0.01
    counts = torch.tensor([4, 0, 3])
    return x, w, s, pts, counts, dict(x=[x], weight=[packed], bias=[bias.float()], scale=[scale],
                                      per_token_scale=[pts], group_list=counts, split_item=2,
                                      group_type=0, group_list_type=1, output_dtype=torch.bfloat16)


def _a8w4(torch_npu, kw):
    kw = dict(kw)
    return torch_npu.npu_grouped_matmul(kw.pop("x"), kw.pop("weight"), **kw)[0]


def test_a8w4_grouped_matmul_is_x_times_the_dequantized_experts(torch_npu):
    """With the page's bias (8 * sum_k(w * scale)) the -8 cancels: expert i's rows are
    x @ (w_i * scale_i) * per_token_scale, with scale_i per group of 256 rows of K."""
    x, w, s, pts, counts, kw = _a8w4_inputs()
    y = _a8w4(torch_npu, kw)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    start = 0
    for i, c in enumerate(counts.tolist()):
        deq = w[i].double() * s[i].double().repeat_interleave(256, dim=0)
        ref = x[start:start + c].double() @ deq * pts[start:start + c].double().unsqueeze(-1)
        torch.testing.assert_close(y[start:start + c].double(), ref, rtol=2 ** -7, atol=1e-6)
        start += c


def test_a8w4_uses_the_bias_it_is_given(torch_npu):
    """A stale scale_bias is not silently ignored: the page's formula adds the bias it gets,
    so half the bias leaves (bias_given - bias_true) * per_token_scale in every row."""
    x, w, s, pts, counts, kw = _a8w4_inputs(bias_ok=False)
    *_, good = _a8w4_inputs()
    y = _a8w4(torch_npu, kw).double()
    start = 0
    for i, c in enumerate(counts.tolist()):
        if not c:
            continue
        rows = slice(start, start + c)
        deq = w[i].double() * s[i].double().repeat_interleave(256, dim=0)
        shift = kw["bias"][0][i].double() - good["bias"][0][i].double()
        exact = x[rows].double() @ deq
        want = (exact + shift) * pts[rows].double().unsqueeze(-1)
        torch.testing.assert_close(y[rows], want, rtol=2 ** -7, atol=1e-6)
        assert (y[rows] - exact * pts[rows].double().unsqueeze(-1)).abs().max() > 0.1 * want.abs().max()
        start += c


def test_a8w4_reads_group_list_as_counts_whatever_its_type(torch_npu):
    """The page: the op assumes group_list_type 1 and does not check it."""
    *_, kw = _a8w4_inputs()
    as_type0 = dict(kw, group_list_type=0)
    assert torch.equal(_a8w4(torch_npu, kw), _a8w4(torch_npu, as_type0))


@pytest.mark.parametrize("change,match", [
    (lambda kw: kw.update(bias=None), "bias: is required"),
    (lambda kw: kw.update(scale=[kw["scale"][0].float()]), "scale: must be uint64"),
    (lambda kw: kw.update(scale=[kw["scale"][0][:, :1]]), "scale: must be uint64"),
    (lambda kw: kw.update(x=[kw["x"][0][:, :256].contiguous()], weight=[kw["weight"][0][:, :256].contiguous()],
                          scale=[kw["scale"][0][:, :1].contiguous()]), None),
    (lambda kw: kw.update(x=[kw["x"][0][:, :128].contiguous()], weight=[kw["weight"][0][:, :128].contiguous()]),
     "multiple of quantGroupSize 256"),
    (lambda kw: kw.update(output_dtype=torch.float32), "output_dtype"),
    (lambda kw: kw.update(per_token_scale=None), "per_token_scale"),
    (lambda kw: kw.update(offset=[torch.zeros(E, 1, N)]), "asymmetric A8W4"),
    (lambda kw: kw.update(group_list=torch.tensor([4, 0, 2])), "must equal x's first dim"),
    (lambda kw: kw.update(weight=[kw["weight"][0].transpose(1, 2).contiguous().transpose(1, 2)]),
     "must not be transposed"),
    (lambda kw: kw.update(group_type=-1), "group_type/act_type"),
])
def test_a8w4_refusals_name_the_rule_and_the_page(torch_npu, change, match):
    *_, kw = _a8w4_inputs()
    change(kw)
    if match is None:  # K=256, one quantization group: accepted
        assert _a8w4(torch_npu, kw).shape == (M, N)
        return
    with pytest.raises(op_rules.OpRuleError, match=match) as e:
        _a8w4(torch_npu, kw)
    assert "npu_grouped_matmul" in str(e.value)


def test_a8w4_refuses_a_uint64_scale_with_high_bits_as_not_emulated(torch_npu):
    *_, kw = _a8w4_inputs()
    kw["scale"] = [kw["scale"][0] | (1 << 40)]
    with pytest.raises(NotImplementedError, match="bits set above the low 32"):
        _a8w4(torch_npu, kw)


def test_int8_grouped_matmul_is_still_the_w8a8_kernel(torch_npu, monkeypatch):
    seen = []
    monkeypatch.setattr(moe_reference, "npu_grouped_matmul", lambda *a, **k: seen.append(1) or ["w8a8"])
    x = torch.zeros(2, 16, dtype=torch.int8)
    assert torch_npu.npu_grouped_matmul([x], [torch.zeros(2, 16, 8, dtype=torch.int8)],
                                        group_list=torch.tensor([1, 1]), split_item=2, group_type=0,
                                        output_dtype=torch.int32) == ["w8a8"] and seen == [1]
