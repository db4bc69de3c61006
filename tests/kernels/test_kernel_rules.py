"""Each documented rule of the emulated torch_npu ops (`kernels/op_rules.py`) refuses the input
class it forbids, naming op, argument and page; each op page's own example inputs give the
documented output shapes and dtypes. Pure CPU, no stand-ins: these are the emulation's kernels."""
import re

import pytest
import torch

from npu_flashrl.kernels import moe_reference as mr
from npu_flashrl.kernels import op_rules
from npu_flashrl.kernels import reference as ref

I8, I32, I64 = torch.int8, torch.int32, torch.int64
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _i8(*shape):
    return torch.randint(-5, 5, shape, dtype=I8)


# --------------------------------------------------------------------------- refusals

def _qmm(x1=None, x2=None, scale=None, **kw):
    x1 = _i8(4, 8) if x1 is None else x1
    x2 = _i8(8, 6) if x2 is None else x2
    scale = torch.ones(6) if scale is None else scale
    kw.setdefault("output_dtype", BF16)
    return lambda: ref.npu_quant_matmul(x1, x2, scale, **kw)


def _gmm(x=None, w=None, group_list=None, **kw):
    x = _i8(6, 8) if x is None else x
    w = _i8(2, 8, 4) if w is None else w
    kw.setdefault("scale", [torch.ones(2, 4, dtype=BF16)])
    kw.setdefault("per_token_scale", [torch.ones(6)])
    kw.setdefault("output_dtype", BF16)
    kw.setdefault("group_list_type", 1)
    gl = torch.tensor([2, 4]) if group_list is None else group_list
    return lambda: mr.npu_grouped_matmul([x], [w], group_list=gl, split_item=2, group_type=0, **kw)


def _route(x=None, idx=None, **kw):
    x = torch.rand(3, 4) if x is None else x
    idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=I32) if idx is None else idx
    args = dict(active_num=6, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                active_expert_range=[0, 3], quant_mode=-1)
    args.update(kw)
    return lambda: mr.npu_moe_init_routing_v2(x, idx, **args)


def _dsq(x=None, **kw):
    x = torch.randint(-9, 9, (4, 128), dtype=I32) if x is None else x
    args = dict(weight_scale=torch.ones(2, x.shape[1]), activation_scale=torch.ones(x.shape[0]),
                group_index=torch.tensor([1, 3]), activate_left=True, quant_mode=1)
    args.update(kw)
    return lambda: mr.npu_dequant_swiglu_quant(x, **args)


def _gating(x=None, k=2, **kw):
    x = torch.randn(3, 8) if x is None else x
    return lambda: mr.moe_gating_top_k(x, k, **kw)


def _gsq(w_nz=True, **kw):
    x, w = _i8(4, 8), _i8(2, 8, 6)
    if w_nz:
        w = ref.npu_format_cast(w, 29)
    args = dict(x=x, weight=w, group_list=torch.tensor([1, 4]), weight_scale=torch.ones(2, 6),
                x_scale=torch.ones(4))
    args.update(kw)
    return lambda: mr.npu_grouped_matmul_swiglu_quant(**args)


REFUSALS = {
    # npu_quant_matmul: dtypes per argument, shapes, the 65535 limit, table 2's combinations
    "qmm x1 fp16": (_qmm(x1=torch.zeros(4, 8, dtype=F16)), "npu_quant_matmul: x1: dtype"),
    "qmm x2 dtype": (_qmm(x2=torch.zeros(8, 6, dtype=I32)), "npu_quant_matmul: x2: dtype must equal x1's"),
    "qmm x1 1-D": (_qmm(x1=_i8(8)), "npu_quant_matmul: x1: must have 2-6 dims"),
    "qmm k mismatch": (_qmm(x1=_i8(4, 7)), "npu_quant_matmul: x1: last dim 7 must equal"),
    "qmm n > 65535": (_qmm(x1=_i8(1, 1), x2=_i8(1, 65536), scale=torch.ones(1)), "must not exceed 65535"),
    "qmm scale fp16": (_qmm(scale=torch.ones(6, dtype=F16)), "npu_quant_matmul: scale: dtype"),
    "qmm scale shape": (_qmm(scale=torch.ones(5)), "npu_quant_matmul: scale: must be 1-D (t,)"),
    "qmm offset dtype": (_qmm(offset=torch.ones(6, dtype=F16)), "npu_quant_matmul: offset: dtype"),
    "qmm pertoken fp16": (_qmm(pertoken_scale=torch.ones(4, dtype=F16)), "pertoken_scale: dtype"),
    "qmm pertoken shape": (_qmm(pertoken_scale=torch.ones(3)), "pertoken_scale: must be 1-D (m,)"),
    "qmm bias shape": (_qmm(bias=torch.ones(5, dtype=I32)), "npu_quant_matmul: bias: must be (n,)"),
    "qmm fp32 output": (_qmm(output_dtype=F32), "output_dtype: must be None/int8, float16, bfloat16 or int32"),
    "qmm fp16 out + pertoken + bf16 scale": (
        _qmm(scale=torch.ones(6, dtype=BF16), pertoken_scale=torch.ones(4), output_dtype=F16),
        "is not documented for a float16 output"),
    "qmm fp16 out + fp16 bias": (_qmm(bias=torch.ones(6, dtype=F16), output_dtype=F16),
                                 "is not documented for a float16 output"),
    "qmm bf16 out + int64 scale": (_qmm(scale=torch.ones(6, dtype=I64)), "is not documented for a bfloat16 output"),
    # npu_quantize
    "quantize x int": (lambda: ref.npu_quantize(torch.zeros(2, 3, dtype=I32), torch.ones(3), None, torch.qint8),
                       "npu_quantize: input: dtype"),
    "quantize div scales fp16": (lambda: ref.npu_quantize(torch.zeros(2, 3), torch.ones(3, dtype=F16), None, torch.qint8),
                                 "npu_quantize: scales: dtype must be one of float32, bfloat16 with div_mode=True"),
    "quantize div zp fp32": (lambda: ref.npu_quantize(torch.zeros(2, 3), torch.ones(3), torch.zeros(3), torch.qint8),
                             "npu_quantize: zero_points: dtype"),
    "quantize mul zp dtype": (lambda: ref.npu_quantize(torch.zeros(2, 3), torch.ones(3), torch.zeros(3, dtype=BF16),
                                                      torch.qint8, -1, False), "shape and dtype of scales"),
    "quantize mul quint8": (lambda: ref.npu_quantize(torch.zeros(2, 3), torch.ones(3), None, torch.quint8, -1, False),
                            "npu_quantize: dtype: must be torch.qint8 or torch.quint4x2 with div_mode=False"),
    "quantize div int8 dtype": (lambda: ref.npu_quantize(torch.zeros(2, 3), torch.ones(3), None, torch.int8),
                                "npu_quantize: dtype: must be torch.qint8, torch.quint8 or torch.int32"),
    "quantize mul axis -3": (lambda: ref.npu_quantize(torch.zeros(2, 2, 3), torch.ones(2), None, torch.qint8, -3, False),
                             "npu_quantize: axis"),
    "quantize scales size": (lambda: ref.npu_quantize(torch.zeros(2, 3), torch.ones(2), None, torch.qint8),
                             "npu_quantize: scales: must be 1-D with 1 or 3"),
    # npu_dynamic_quant
    "dq x fp32": (lambda: ref.npu_dynamic_quant(torch.zeros(2, 3)), "npu_dynamic_quant: x: dtype"),
    "dq x 1-D": (lambda: ref.npu_dynamic_quant(torch.zeros(3, dtype=F16)), "more than 1 dim"),
    "dq smooth dtype": (lambda: ref.npu_dynamic_quant(torch.zeros(2, 3, dtype=F16), smooth_scales=torch.ones(3, dtype=BF16)),
                        "smooth_scales: dtype must equal x's"),
    "dq smooth shape": (lambda: ref.npu_dynamic_quant(torch.zeros(2, 3, dtype=F16), smooth_scales=torch.ones(2, dtype=F16)),
                        "smooth_scales: must be 1-D"),
    "dq dst_type": (lambda: ref.npu_dynamic_quant(torch.zeros(2, 3, dtype=F16), dst_type=torch.float16),
                    "npu_dynamic_quant: dst_type"),
    "dq group_index dtype": (lambda: ref.npu_dynamic_quant(torch.zeros(2, 3, dtype=F16), group_index=torch.tensor([2])),
                             "group_index: dtype"),
    # npu_grouped_matmul
    "gmm group_list int32": (_gmm(group_list=torch.tensor([2, 4], dtype=I32)), "npu_grouped_matmul: group_list: dtype"),
    "gmm group_list list": (_gmm(group_list=[2, 4]), "group_list: must be a Tensor"),
    "gmm counts sum < M": (_gmm(group_list=torch.tensor([2, 3])), "its sum (5) must equal x's first dim M=6"),
    "gmm cumsum last < M": (_gmm(group_list=torch.tensor([2, 5]), group_list_type=0), "its last value (5) must equal"),
    "gmm cumsum decreasing": (_gmm(group_list=torch.tensor([4, 2]), group_list_type=0), "non-decreasing"),
    "gmm counts negative": (_gmm(group_list=torch.tensor([-1, 7])), "non-negative"),
    "gmm counts length 1": (_gmm(w=_i8(1, 8, 4), group_list=torch.tensor([6]), scale=[torch.ones(1, 4, dtype=BF16)]),
                            "must not have length 1"),
    "gmm int8 bias bf16": (_gmm(bias=[torch.ones(2, 4, dtype=BF16)]), "npu_grouped_matmul: bias: dtype must be int32"),
    "gmm fp32 scale bf16 out": (_gmm(scale=[torch.ones(2, 4)]), "a float32 scale gives a float16 output"),
    "gmm bf16 scale fp16 out": (_gmm(output_dtype=F16), "a bfloat16 scale gives a bfloat16 output"),
    "gmm pertoken bf16": (_gmm(per_token_scale=[torch.ones(6, dtype=BF16)]), "per_token_scale: dtype"),
    "gmm no scale bf16 out": (_gmm(scale=None, per_token_scale=None), "output_dtype must be int32"),
    "gmm float bias dtype": (lambda: mr.npu_grouped_matmul([torch.zeros(2, 4, dtype=BF16)], [torch.zeros(2, 4, 3, dtype=BF16)],
                                                           bias=[torch.zeros(2, 3, dtype=BF16)], group_list=torch.tensor([1, 1]),
                                                           split_item=2, group_type=0, group_list_type=1),
                             "bias: dtype must be float32 for a bfloat16 x"),
    # npu_moe_init_routing_v2
    "route expert_idx int64": (_route(idx=torch.zeros(3, 2, dtype=I64)), "expert_idx: dtype"),
    "route x 3-D": (_route(x=torch.rand(3, 4, 1)), "x: must be 2-D"),
    "route default quant_mode": (_route(quant_mode=0), "0 (static, the default) is not supported"),
    "route drop pad": (_route(drop_pad_mode=1), "drop_pad_mode: only 0"),
    "route cumsum": (_route(expert_tokens_num_type=0), "only 1 (count) and 2 (key_value)"),
    "route flag off": (_route(expert_tokens_num_flag=False), "expert_tokens_num_flag: only True"),
    "route active_num": (_route(active_num=-1), "active_num: must equal NUM_ROWS*K = 6"),
    "route expert_num": (_route(expert_num=10241), "expert_num: must be in [0, 10240]"),
    "route range": (_route(active_expert_range=[2, 4]), "active_expert_range"),
    "route row_idx_type": (_route(row_idx_type=2), "row_idx_type"),
    "route offset": (_route(offset=torch.zeros(3)), "offset: is not given"),
    "route scale shape": (_route(scale=torch.ones(3, 1)), "scale: must be 1-D (NUM_ROWS,)"),
    # npu_moe_token_unpermute
    "unpermute int64 idx": (lambda: mr.npu_moe_token_unpermute(torch.zeros(4, 2), torch.arange(4)), "sorted_indices: dtype"),
    "unpermute int tokens": (lambda: mr.npu_moe_token_unpermute(torch.zeros(4, 2, dtype=I32), torch.arange(4, dtype=I32)),
                             "permuted_tokens: dtype"),
    "unpermute idx count": (lambda: mr.npu_moe_token_unpermute(torch.zeros(4, 2), torch.arange(3, dtype=I32)),
                            "one entry per permuted token"),
    # npu_dequant_swiglu_quant
    "dsq x fp16": (_dsq(x=torch.zeros(4, 128, dtype=F16)), "npu_dequant_swiglu_quant: x: dtype"),
    "dsq odd last dim": (_dsq(x=torch.zeros(4, 127, dtype=I32)), "even last dim"),
    "dsq int32 without scales": (_dsq(weight_scale=None), "an int32 x needs both"),
    "dsq weight_scale bf16": (_dsq(weight_scale=torch.ones(2, 128, dtype=BF16)), "weight_scale: dtype"),
    "dsq H not 64-aligned": (_dsq(x=torch.zeros(4, 96, dtype=I32)), "H=48 must be <= 10496 and a multiple of 64"),
    "dsq group int32": (_dsq(group_index=torch.tensor([1, 3], dtype=I32)), "group_index: dtype"),
    "dsq groups > tokens": (_dsq(group_index=torch.tensor([3, 3])), "must not exceed TokensNum=4"),
    "dsq static with groups": (_dsq(quant_mode=0), "must be 1 (dynamic) with group_index"),
    # gating top-k
    "gating bias dtype": (_gating(bias=torch.zeros(8, dtype=BF16)), "bias: dtype must equal x's"),
    "gating bias shape": (_gating(bias=torch.zeros(7)), "bias: must be 1-D (8,)"),
    "gating k too big": (_gating(k=5, group_count=4, k_group=2), "1 <= k <= x.shape[-1] / group_count * k_group = 4"),
    "gating group_count": (_gating(group_count=3), "group_count: must divide"),
    "gating experts > 2048": (_gating(x=torch.zeros(1, 2049)), "must not exceed 2048"),
    "gating x int": (_gating(x=torch.zeros(3, 8, dtype=I32)), "x: dtype"),
    "softmax k > 1024": (lambda: mr.npu_moe_gating_top_k_softmax(torch.zeros(1, 2048), k=1025), "k: must be in"),
    "swiglu odd dim": (lambda: mr.npu_swiglu(torch.zeros(2, 3)), "npu_swiglu: x: dim -1 must have an even size"),
    "swiglu int": (lambda: mr.npu_swiglu(torch.zeros(2, 4, dtype=I32)), "npu_swiglu: x: dtype"),
    # grouped matmul + swiglu + quant (WeightNZ kernel)
    "gsq ND weight": (_gsq(w_nz=False), "weight: an int8 weight must be FRACTAL_NZ"),
    "gsq x_scale bf16": (_gsq(x_scale=torch.ones(4, dtype=BF16)), "x_scale: dtype"),
    "gsq group_list int32": (_gsq(group_list=torch.tensor([1, 4], dtype=I32)), "group_list: dtype"),
    "gsq group_list > rows": (_gsq(group_list=torch.tensor([1, 5])), "must not exceed x's rows 4"),
    # formats
    "format_cast float id": (lambda: ref.npu_format_cast(torch.zeros(2), 29.0), "acl_format: must be an int"),
    "format_cast unknown id": (lambda: ref.npu_format_cast(torch.zeros(2), 99), "aclFormat ids"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_documented_rule_refuses(case):
    call, match = REFUSALS[case]
    with pytest.raises(op_rules.OpRuleError, match=re.escape(match)) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(("torch_npu.", "torch.ops._C_ascend.")) and "(documented: https://" in msg


def test_every_rule_source_is_a_page():
    assert all(url.startswith("https://") for url in op_rules.DOC.values())


# --------------------------------------------------------------------------- the pages' examples

def test_quant_matmul_page_example_shape_and_dtype():
    # the bf16 graph-mode example: m=15, k=11264, n=6912 -> (15, 6912) bf16 (k, n scaled down)
    m, k, n = 15, 1126, 691
    out = ref.npu_quant_matmul(_i8(m, k), _i8(n, k).t(), torch.randn(n, dtype=BF16),
                               pertoken_scale=torch.randn(m), bias=torch.randn(n, dtype=BF16),
                               output_dtype=BF16)
    assert out.shape == (m, n) and out.dtype == BF16


def test_dynamic_quant_page_example():
    x = torch.tensor([[0.7261, 0.3726, 0.9126], [0.9023, 0.9990, 0.1279], [0.8628, 0.6240, 0.9028]], dtype=F16)
    q, s = ref.npu_dynamic_quant(x)
    assert q.tolist() == [[101, 52, 127], [115, 127, 16], [121, 88, 127]]  # the page's output
    assert s.dtype == F32 and s.shape == (3,)
    assert [round(v, 4) for v in s.tolist()] == [0.0072, 0.0079, 0.0071]
    # the graph-mode example's shapes: x (2, 4, 6) fp16 with smooth_scales (6,) -> y (2, 4, 6), scale (2, 4)
    q3, s3 = ref.npu_dynamic_quant(torch.randn(2, 4, 6, dtype=F16), smooth_scales=torch.randn(6, dtype=F16))
    assert q3.shape == (2, 4, 6) and q3.dtype == I8 and s3.shape == (2, 4) and s3.dtype == F32


def test_quantize_page_example():
    out = ref.npu_quantize(torch.randn(1, 1, 12).bfloat16(), torch.tensor([0.1] * 12).bfloat16(), None,
                           torch.qint8, -1, False)
    assert out.shape == (1, 1, 12) and out.dtype == I8


def test_init_routing_v2_page_example():
    bs, h, k, expert_num = 1, 613, 475, 226
    x = torch.randn(bs, h)
    idx = torch.randint(0, expert_num, (bs, k), dtype=I32)
    ex, row_idx, counts, scale = mr.npu_moe_init_routing_v2(
        x, idx, scale=torch.randn(bs), active_num=475, expert_capacity=-1, expert_num=expert_num,
        drop_pad_mode=0, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[23, 35], quant_mode=-1, row_idx_type=0)
    assert ex.shape == (bs * k, h) and ex.dtype == x.dtype
    assert row_idx.shape == (bs * k,) and row_idx.dtype == I32
    assert counts.shape == (35 - 23,) and counts.dtype == I64
    assert scale.shape == (bs * k,) and scale.dtype == F32
    assert int(counts.sum()) == int(((idx >= 23) & (idx < 35)).sum())


def test_dequant_swiglu_quant_page_example_shapes():
    # the page's example: x [4608, 2048] int32, weight_scale [2048] (1-D: the page's own example,
    # though its text says 2-D), activation_scale [4608, 1], quant_scale [1, 1024] (smooth: not
    # emulated). Scaled down: [8, 256].
    x = torch.randint(-10, 10, (8, 256), dtype=I32)
    y, s = mr.npu_dequant_swiglu_quant(x, weight_scale=torch.randn(256), activation_scale=torch.randn(8, 1),
                                       activate_left=False, quant_mode=1)
    assert y.shape == (8, 128) and y.dtype == I8 and s.shape == (8,) and s.dtype == F32


def test_swiglu_page_example():
    out = mr.npu_swiglu(torch.randn(2, 32, 6, 6), dim=-1)
    assert out.shape == (2, 32, 6, 3) and out.dtype == F32


def test_format_cast_page_example_returns_a_new_tensor():
    x = torch.rand(2, 3, 4, 5)
    assert ref.get_npu_format(x) == 0  # the page: a fresh 4-D tensor reports 0 (NCHW)
    x1 = ref.npu_format_cast(x, 29)
    assert ref.get_npu_format(x1) == 29
    assert ref.get_npu_format(x) == 0 and x1 is not x  # the input is left as it was
    assert torch.equal(x1, x)
    w = _i8(4, 8)
    assert ref.get_npu_format(w) == 2  # 2-D: ND
    assert ref.npu_format_cast(w, 2) is w  # nothing to convert
