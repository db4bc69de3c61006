"""The fused-MoE reference kernels (`kernels.moe_reference`) against hand computations.

Every expected value is worked out here by explicit loops over tiny tensors (math.exp, Python
sums, a per-row absmax), following each op's documented formula (sources in the kernels'
docstrings), never by calling the kernel's own helpers. Plus: the emulated torch_npu names and
vllm-ascend's `_C_ascend` custom ops reach these kernels with the keywords vllm-ascend passes,
unsupported modes and mixed-device operands are refused by name.
"""
import math

import pytest
import torch

from npu_flashrl.kernels import emulation, int4_moe
from npu_flashrl.kernels import moe_reference as mr


def _softmax_row(row):
    ex = [math.exp(v - max(row)) for v in row]
    return [v / sum(ex) for v in ex]


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _q_row(vals):
    """Symmetric int8 of one row, by hand: scale = max|v| / 127, q = round-half-even(v / scale)."""
    scale = max(abs(v) for v in vals) / 127.0
    return [max(-128, min(127, round(v / scale))) for v in vals], scale


def _swish(v):
    return v * _sigmoid(v)


# --------------------------------------------------------------------------- gating

def test_gating_top_k_softmax_renorm_by_hand():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, -1.0, 2.0]])
    y, idx, out = mr.moe_gating_top_k(x, 2, renorm=1, norm_type=0)
    for t, row in enumerate(x.tolist()):
        p = _softmax_row(row)
        order = sorted(range(4), key=lambda e: (-p[e], e))[:2]  # ties: the lower index first
        assert idx[t].tolist() == order
        total = sum(p[e] for e in order)
        assert y[t].tolist() == pytest.approx([p[e] / total for e in order], rel=1e-6)
    assert idx.dtype == torch.int32 and y.dtype == x.dtype and out.numel() == 0


def test_gating_top_k_tie_keeps_lower_index_and_renorm0_keeps_softmax_values():
    x = torch.tensor([[2.0, 1.0, 2.0, 1.0]])
    y, idx, _ = mr.moe_gating_top_k(x, 2, renorm=0, norm_type=0)
    assert idx.tolist() == [[0, 2]]
    p = _softmax_row(x[0].tolist())
    assert y[0].tolist() == pytest.approx([p[0], p[2]], rel=1e-6)  # no renormalisation


def test_gating_top_k_sigmoid_bias_and_groups_by_hand():
    x = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, -0.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, -3.0, 0.0, 0.0])
    # 2 groups of 3 experts; group score = max of (sigmoid + bias); keep the best group only
    y, idx, out = mr.moe_gating_top_k(x, 2, bias=bias, k_group=1, group_count=2,
                                      group_select_mode=0, norm_type=1, out_flag=True,
                                      routed_scaling_factor=2.0)
    s = [_sigmoid(v) for v in x[0].tolist()]
    biased = [a + b for a, b in zip(s, bias.tolist())]
    groups = [biased[0:3], biased[3:6]]
    best = max(range(2), key=lambda g: (max(groups[g]), -g))
    cand = [best * 3 + j for j in range(3)]
    order = sorted(cand, key=lambda e: (-biased[e], e))[:2]
    assert idx[0].tolist() == order
    total = sum(s[e] for e in order) + 1e-20
    assert y[0].tolist() == pytest.approx([2.0 * s[e] / total for e in order], rel=1e-6)
    assert out[0].tolist() == pytest.approx(s, rel=1e-6)  # the unbiased norm


def test_gating_top_k_softmax_op_by_hand():
    x = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 2.0]])
    y, idx, row_idx = mr.npu_moe_gating_top_k_softmax(x, None, k=2)
    for t, row in enumerate(x.tolist()):
        p = _softmax_row(row)
        order = sorted(range(3), key=lambda e: -p[e])[:2]
        assert idx[t].tolist() == order
        assert y[t].tolist() == pytest.approx([p[e] for e in order], rel=1e-6)
    # rowIdxOut = arange(N*k).reshape(k, N).T: row t, slot j -> j*N + t
    assert row_idx.tolist() == [[j * 2 + t for j in range(2)] for t in range(2)]


# --------------------------------------------------------------------------- init routing

X3 = torch.tensor([[1.0, -2.0], [0.5, 4.0], [-3.0, 0.25]], dtype=torch.bfloat16)
IDX3 = torch.tensor([[2, 0], [1, 2], [0, 1]], dtype=torch.int32)
# the torch_npu op's documented settings (active_num = NUM_ROWS*K, count type with the flag on,
# no quant or dynamic quant); the shared kernel (`moe_init_routing`) also takes the others
ROUTE = dict(active_num=6, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True,
             active_expert_range=[0, 3], quant_mode=-1)


def _sorted_entries(idx, start, end):
    """Flat (token*K + slot) entries sorted by expert, in flat order within an expert, by loops."""
    flat = [e for row in idx.tolist() for e in row]
    return [i for ex in range(start, end) for i in range(len(flat)) if flat[i] == ex]


def test_init_routing_dropless_by_hand():
    ex, row_idx, counts, scale = mr.npu_moe_init_routing_v2(
        X3, IDX3, active_num=6, expert_num=3, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, 3], quant_mode=-1)
    order = _sorted_entries(IDX3, 0, 3)
    assert order == [1, 4, 2, 5, 0, 3]
    for i, entry in enumerate(order):
        assert ex[i].tolist() == X3[entry // 2].tolist()
    expected_row_idx = [None] * 6
    for i, entry in enumerate(order):
        expected_row_idx[entry] = i  # gather index (row_idx_type 0)
    assert row_idx.tolist() == expected_row_idx and row_idx.dtype == torch.int32
    assert counts.tolist() == [2, 2, 2] and counts.dtype == torch.int64
    _, _, cumsum, _ = mr.moe_init_routing(X3, IDX3, expert_num=3, expert_tokens_num_type=0,
                                          expert_tokens_num_flag=True)
    assert cumsum.tolist() == [2, 4, 6]
    _, scatter, _, _ = mr.npu_moe_init_routing_v2(X3, IDX3, **{**ROUTE, "row_idx_type": 1})
    assert scatter.tolist() == order


def test_init_routing_dynamic_quant_by_hand():
    ex, _, _, scale = mr.npu_moe_init_routing_v2(X3, IDX3, **{**ROUTE, "quant_mode": 1})
    assert ex.dtype == torch.int8 and scale.dtype == torch.float32
    for i, entry in enumerate(_sorted_entries(IDX3, 0, 3)):
        q, s = _q_row([float(v) for v in X3[entry // 2].float().tolist()])
        assert ex[i].tolist() == q
        assert float(scale[i]) == pytest.approx(s, rel=1e-6)


def test_init_routing_active_expert_range_by_hand():
    ex, row_idx, counts, _ = mr.npu_moe_init_routing_v2(X3, IDX3, **{**ROUTE, "active_expert_range": [1, 3]})
    order = _sorted_entries(IDX3, 1, 3)  # expert 0's entries are not routed
    assert order == [2, 5, 0, 3]
    for i, entry in enumerate(order):
        assert ex[i].tolist() == X3[entry // 2].tolist()
    assert ex[len(order):].abs().sum() == 0
    expected = [-1] * 6
    for i, entry in enumerate(order):
        expected[entry] = i
    assert row_idx.tolist() == expected
    assert counts.tolist() == [2, 2]


def test_unpermute_by_hand():
    permuted = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    sorted_indices = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    out = mr.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    for i in range(2):
        want = [sum(permuted[int(sorted_indices[i * 2 + j])][c].item() * probs[i][j].item()
                    for j in range(2)) for c in range(2)]
        assert out[i].tolist() == pytest.approx(want)
    # routing then unpermuting with weight 1 per slot gives K copies of each token back
    ex, row_idx, _, _ = mr.npu_moe_init_routing_v2(X3.float(), IDX3, **ROUTE)
    back = mr.npu_moe_token_unpermute(ex, row_idx, torch.ones(3, 2))
    assert back.tolist() == (2 * X3.float()).tolist()


# --------------------------------------------------------------------------- grouped matmuls

def _group_of(row, counts):
    acc = 0
    for g, c in enumerate(counts):
        acc += c
        if row < acc:
            return g
    return None


def test_grouped_matmul_per_token_by_hand():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-5, 6, (4, 3), generator=g, dtype=torch.int8)
    w = torch.randint(-5, 6, (3, 3, 2), generator=g, dtype=torch.int8)   # [E, K, N]
    scale = torch.tensor([[0.5, 1.0], [2.0, 0.25], [1.5, 3.0]], dtype=torch.bfloat16)
    pts = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = [2, 0, 2]  # an empty group; the groups cover every row (documented)
    out = mr.npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[pts],
                                group_list=torch.tensor(counts), split_item=2, group_type=0,
                                group_list_type=1, output_dtype=torch.bfloat16)[0]
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (4, 2)
    for r in range(4):
        grp = _group_of(r, counts)
        for n in range(2):
            if grp is None:
                assert out[r, n].item() == 0.0
                continue
            acc = sum(int(x[r, k]) * int(w[grp, k, n]) for k in range(3))
            want = acc * float(scale[grp, n]) * float(pts[r])
            assert out[r, n].item() == pytest.approx(want, rel=1e-2, abs=1e-3)  # bf16 output
    cumsum = mr.npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[pts],
                                   group_list=torch.tensor([2, 2, 4]), split_item=2, group_type=0,
                                   group_list_type=0, output_dtype=torch.bfloat16)[0]
    assert torch.equal(cumsum, out)


def test_grouped_matmul_int32_and_float_by_hand():
    x = torch.tensor([[1, -2], [3, 4], [-1, 1]], dtype=torch.int8)
    w = [torch.tensor([[1, 2], [3, 4]], dtype=torch.int8), torch.tensor([[-1, 0], [0, 2]], dtype=torch.int8)]
    out = mr.npu_grouped_matmul([x], w, group_list=torch.tensor([1, 2]), split_item=3, group_type=0,
                                group_list_type=1, output_dtype=torch.int32)[0]
    want = [[sum(int(x[r, k]) * int(w[0 if r < 1 else 1][k, n]) for k in range(2)) for n in range(2)]
            for r in range(3)]
    assert out.tolist() == want and out.dtype == torch.int32
    xf = torch.tensor([[0.5, 1.0], [2.0, -1.0]])
    wf = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[2.0, 1.0], [1.0, 2.0]]])
    outf = mr.npu_grouped_matmul([xf], [wf], group_list=torch.tensor([1, 1]), split_item=2,
                                 group_type=0, group_list_type=1)[0]
    assert outf.tolist() == [[0.5, 1.0], [2.0 * 2 + -1.0 * 1, 2.0 * 1 + -1.0 * 2]]


def test_grouped_matmul_swiglu_quant_by_hand():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-4, 5, (4, 3), generator=g, dtype=torch.int8)
    w = torch.randint(-4, 5, (2, 3, 4), generator=g, dtype=torch.int8)   # N = 4: gate 2 + up 2
    w_scale = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.125, 1.0]])
    x_scale = torch.tensor([1.0, 0.5, 2.0, 0.75])
    q, qs, qo = mr.grouped_matmul_swiglu_quant(x, w, w_scale, x_scale, torch.tensor([1, 3]))
    # the WeightNZ variant takes an NZ weight only (same values: the emulated cast keeps bytes)
    from npu_flashrl.kernels import reference

    with pytest.raises(ValueError, match="weight: an int8 weight must be FRACTAL_NZ"):
        mr.grouped_matmul_swiglu_quant_weight_nz(x, w, w_scale, x_scale, torch.tensor([1, 3]))
    nz = mr.grouped_matmul_swiglu_quant_weight_nz(x, reference.npu_format_cast(w, 29), w_scale,
                                                  x_scale, torch.tensor([1, 3]))
    assert all(torch.equal(a, b) for a, b in zip(nz, (q, qs, qo)))
    for r in range(4):
        grp = 0 if r < 1 else 1 if r < 3 else None
        if grp is None:  # past groupList[-1]
            assert q[r].abs().sum() == 0 and qs[r] == 0
            continue
        c = [sum(int(x[r, k]) * int(w[grp, k, n]) for k in range(3)) * float(x_scale[r]) *
             float(w_scale[grp, n]) for n in range(4)]
        s = [_swish(c[j]) * c[j + 2] for j in range(2)]
        want_q, want_s = _q_row(s)
        assert q[r].tolist() == want_q
        assert float(qs[r]) == pytest.approx(want_s, rel=1e-5)
    assert qo.abs().sum() == 0 and q.dtype == torch.int8


def test_dequant_swiglu_quant_by_hand():
    # with group_index, H must be a multiple of 64 (documented): 2H = 128
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-40, 41, (3, 128), generator=g, dtype=torch.int32)
    w_scale = torch.rand(2, 128, generator=g) * 0.05
    a_scale = torch.tensor([1.0, 0.5, 2.0])
    for left in (True, False):
        q, s = mr.npu_dequant_swiglu_quant(x, weight_scale=w_scale, activation_scale=a_scale,
                                           group_index=torch.tensor([1, 2]), activate_left=left,
                                           quant_mode=1)
        for r in range(3):
            grp = 0 if r < 1 else 1
            d = [int(x[r, c]) * float(w_scale[grp, c]) * float(a_scale[r]) for c in range(128)]
            a, b = d[:64], d[64:]
            y = [_swish(a[j]) * b[j] if left else _swish(b[j]) * a[j] for j in range(64)]
            want_q, want_s = _q_row(y)
            # fp32 kernel vs float64 loops: a value within fp32 rounding of a .5 tie may differ by 1
            assert max(abs(u - v) for u, v in zip(q[r].tolist(), want_q)) <= 1
            assert float(s[r]) == pytest.approx(want_s, rel=1e-5)


def test_swiglu_by_hand():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    assert mr.npu_swiglu(x)[0].tolist() == pytest.approx([_swish(1.0) * 3.0, _swish(-2.0) * 0.5], rel=1e-6)


# --------------------------------------------------------------------------- refusals

def test_unsupported_modes_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="moe_init_routing: drop_pad_mode=1"):
        mr.moe_init_routing(X3, IDX3, expert_num=3, drop_pad_mode=1)
    with pytest.raises(NotImplementedError, match="npu_grouped_matmul: antiquant_scale"):
        mr.npu_grouped_matmul([X3], [torch.zeros(1, 2, 2)], antiquant_scale=[torch.ones(1, 2)],
                              group_list=torch.tensor([3]), split_item=2, group_type=0)
    with pytest.raises(NotImplementedError, match="swiglu_limit"):
        mr.grouped_matmul_swiglu_quant(torch.zeros(1, 2, dtype=torch.int8),
                                       torch.zeros(1, 2, 2, dtype=torch.int8), torch.ones(1, 2),
                                       torch.ones(1), torch.tensor([1]), swiglu_limit=7.0)
    with pytest.raises(ValueError, match="group_list: counts must be non-negative"):
        mr.npu_grouped_matmul([torch.zeros(2, 2)], [torch.zeros(1, 2, 2)],
                              group_list=torch.tensor([-1]), split_item=2, group_type=0,
                              group_list_type=1)


@pytest.mark.parametrize("case", ["gating", "routing", "unpermute", "gmm", "gmm_swiglu"])
def test_mixed_device_operands_are_refused(case):
    """Stand-in for the second device: `meta` (no NPU on CPU CI), refused as cpu+npu would be."""
    meta = lambda t: t.to("meta")  # noqa: E731
    calls = {
        "gating": lambda: mr.moe_gating_top_k(torch.zeros(2, 4), 2, bias=meta(torch.zeros(4))),
        "routing": lambda: mr.npu_moe_init_routing_v2(X3, meta(IDX3), expert_num=3),
        "unpermute": lambda: mr.npu_moe_token_unpermute(torch.zeros(4, 2), torch.arange(4),
                                                        meta(torch.ones(2, 2))),
        "gmm": lambda: mr.npu_grouped_matmul([torch.zeros(2, 2)], [meta(torch.zeros(1, 2, 2))],
                                             group_list=torch.tensor([2]), split_item=2, group_type=0),
        "gmm_swiglu": lambda: mr.grouped_matmul_swiglu_quant(
            torch.zeros(1, 2, dtype=torch.int8), torch.zeros(1, 2, 2, dtype=torch.int8),
            meta(torch.ones(1, 2)), torch.ones(1), torch.tensor([1])),
    }
    with pytest.raises(ValueError, match=r"operands are on different devices .* on meta"):
        calls[case]()


# --------------------------------------------------------------------------- wiring

def test_ascend_c_ops_reach_the_kernels_with_vllm_ascends_keywords():
    """vllm-ascend's compiled MoE ops, defined on the CPU by `register_cpu_ops` with the schemas
    of v0.23.0's csrc/torch_binding.cpp, called the way device_op.py / moe_mlp.py call them."""
    emulation.register_cpu_ops()
    ops = getattr(torch.ops, emulation.ASCEND_C_NAMESPACE)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16)
    y, idx, _ = ops.moe_gating_top_k(logits, k=2, k_group=1, group_count=1, group_select_mode=1,
                                     renorm=1, norm_type=0, out_flag=False,
                                     routed_scaling_factor=1.0, eps=1e-20, bias_opt=None)
    want = mr.moe_gating_top_k(logits, 2, renorm=1)
    assert torch.equal(y, want[0]) and torch.equal(idx, want[1])
    got = ops.npu_moe_init_routing_custom(X3, IDX3, scale=None, active_num=6, expert_num=3,
                                          expert_tokens_num_type=1, expert_tokens_num_flag=True,
                                          active_expert_range=[0, 3], quant_mode=1)
    want = mr.npu_moe_init_routing_v2(X3, IDX3, active_num=6, expert_num=3, expert_tokens_num_type=1,
                                      expert_tokens_num_flag=True, active_expert_range=[0, 3],
                                      quant_mode=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    x = torch.ones(2, 3, dtype=torch.int8)
    w = torch.ones(1, 3, 4, dtype=torch.int8)
    w = emulation.reference.npu_format_cast(w, 29)  # the NZ variant takes an NZ weight
    got = ops.grouped_matmul_swiglu_quant_weight_nz(x=x, weight=w, weight_scale=torch.ones(1, 4),
                                                    x_scale=torch.ones(2), group_list=torch.tensor([2]),
                                                    bias=None, swiglu_limit=0.0)
    want = mr.grouped_matmul_swiglu_quant(x, w, torch.ones(1, 4), torch.ones(2), torch.tensor([2]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_torch_npu_names_are_the_kernels():
    emulation.install()
    import torch_npu

    assert torch_npu.npu_moe_init_routing_v2 is mr.npu_moe_init_routing_v2
    # the int4-aware entry (A8W4 for W4A8 MoE), which hands every other form to mr's kernel
    assert torch_npu.npu_grouped_matmul is int4_moe.npu_grouped_matmul
    assert torch_npu.npu_moe_token_unpermute is mr.npu_moe_token_unpermute
    x = torch.ones(2, 3, dtype=torch.int8)
    w = torch_npu.npu_format_cast(torch.ones(1, 3, 4, dtype=torch.int8), 29)
    got = torch_npu.npu_grouped_matmul_swiglu_quant(x=x, weight=w, group_list=torch.tensor([2]),
                                                    weight_scale=torch.ones(1, 4), x_scale=torch.ones(2))
    want = mr.grouped_matmul_swiglu_quant(x, w, torch.ones(1, 4), torch.ones(2), torch.tensor([2]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(NotImplementedError, match="hash mode"):
        torch_npu.npu_moe_gating_top_k(torch.zeros(1, 4), 2, input_ids=torch.zeros(1))
