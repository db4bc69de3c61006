"""Op-level conformance cases of the torch_npu ops npu_flashrl relies on (`npu-flashrl verify --kernels`).

Each case builds small inputs on the CPU, calls the op by its torch_npu name (the real torch_npu on
an NPU host, the emulation elsewhere) and compares the result with a golden computed here from
the op page's formula in float64 / plain torch, independently of `reference.py`. Cases marked
`valid=False` feed an input the page rejects: the emulation must refuse it; a real device that
accepts it is reported (the page is stricter than the device) without failing the run.

Tolerance (`INT8_ABS_TOL`, `SCALE_RTOL`): Huawei's own op test of npu_dynamic_quant
(Ascend op-plugin test/test_custom_ops/test_npu_dynamic_quant.py) compares the int8 output with
`assertTensorsSlowEqual(golden, npu, 1)` (a difference of 1 allowed: the device may round a value
at a .5 tie, or one ulp from it, the other way) and the float32 scale with
`assertRtolEqual(golden, npu, 0.0001)`. Float outputs (bf16 / fp16) are compared within two units
in their last place, the rounding of the output cast plus one fp32 rounding before it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

# Huawei's op test for int8 results (see the module docstring)
INT8_ABS_TOL = 1
SCALE_RTOL = 1e-4
_FLOAT_ULPS = {torch.bfloat16: 2 * 2.0 ** -7, torch.float16: 2 * 2.0 ** -10, torch.float32: SCALE_RTOL}

MATCHES, DIFFERS, REFUSED, ACCEPTS_INVALID = "matches", "differs", "refused by device", "accepts invalid"


@dataclasses.dataclass
class Case:
    op: str
    name: str
    build: Callable[[], Tuple[tuple, dict]]  # CPU inputs (args, kwargs)
    golden: Optional[Callable[..., object]] = None  # same args -> expected outputs (valid cases)
    valid: bool = True
    nz_args: Tuple[int, ...] = ()  # positional args to cast to FRACTAL_NZ on the device


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dq_rows(y: torch.Tensor):
    """The dynamic quantization every page shares: scale = rowmax|y| / 127, q = round(y / scale)."""
    y = y.double()
    scale = y.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(y / safe.unsqueeze(-1)).clamp(-128, 127).to(torch.int8), scale.float()


def _swish(z):
    return z * torch.sigmoid(z)


# --------------------------------------------------------------------------- cases

def _dynamic_quant():
    x = torch.rand(3, 3, generator=_g(0)).to(torch.float16)  # the page's example: rand((3, 3)) fp16
    return (x,), {}


def _quantize():
    # the page's A2 example: randn(1, 1, 12) bf16, scale [0.1] * 12 bf16, div_mode False
    x = torch.randn(1, 1, 12, generator=_g(1)).bfloat16()
    return (x, torch.tensor([0.1] * 12).bfloat16(), None, torch.qint8, -1, False), {}


def _quant_matmul_pertoken():
    x1 = torch.randint(-5, 5, (15, 64), generator=_g(2), dtype=torch.int8)
    x2 = torch.randint(-5, 5, (64, 32), generator=_g(3), dtype=torch.int8)
    scale = (torch.rand(32, generator=_g(4)) * 0.01).bfloat16()
    pts = torch.rand(15, generator=_g(5)) * 0.1
    return (x1, x2, scale), {"pertoken_scale": pts, "output_dtype": torch.bfloat16}


def _quant_matmul_golden(x1, x2, scale, pertoken_scale=None, bias=None, output_dtype=None, offset=None):
    out = (x1.double() @ x2.double()) * scale.double()
    if pertoken_scale is not None:
        out = out * pertoken_scale.double().unsqueeze(-1)
    return out.to(output_dtype)


def _quant_matmul_fp16_half_scale():
    # vllm-ascend's fp16 W8A8_DYNAMIC call: a float16 scale with a per-token scale (not in table 2)
    args, kw = _quant_matmul_pertoken()
    return (args[0], args[1], args[2].half()), {"pertoken_scale": kw["pertoken_scale"], "output_dtype": torch.float16}


def _gmm_pertoken(rows_covered: Optional[int] = None):
    def build():
        x = torch.randint(-5, 5, (8, 16), generator=_g(6), dtype=torch.int8)
        w = torch.randint(-5, 5, (3, 16, 8), generator=_g(7), dtype=torch.int8)
        scale = (torch.rand(3, 8, generator=_g(8)) * 0.01).bfloat16()
        pts = torch.rand(8, generator=_g(9))
        counts = [3, 0, 5] if rows_covered is None else [2, 0, rows_covered - 2]
        return ([x], [w]), {"scale": [scale], "per_token_scale": [pts],
                            "group_list": torch.tensor(counts, dtype=torch.int64), "split_item": 2,
                            "group_type": 0, "group_list_type": 1, "output_dtype": torch.bfloat16}
    return build


def _gmm_golden(x, w, scale, per_token_scale, group_list, **_):
    x, w, s, p = x[0], w[0], scale[0], per_token_scale[0]
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, c in enumerate(group_list.tolist()):
        out[start:start + c] = (x[start:start + c].double() @ w[e].double()) * s[e].double() \
            * p[start:start + c].double().unsqueeze(-1)
        start += c
    return [out.to(torch.bfloat16)]


def _init_routing():
    x = torch.tensor([[0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2], [0.3, 0.3, 0.3, 0.3]])
    idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    return (x, idx), {"active_num": 6, "expert_num": 3, "expert_tokens_num_type": 1,
                      "expert_tokens_num_flag": True, "active_expert_range": [0, 3], "quant_mode": -1}


def _init_routing_golden(x, idx, **_):
    flat = idx.reshape(-1).tolist()
    k = idx.shape[1]
    order = sorted(range(len(flat)), key=lambda i: (flat[i], i))
    expanded_x = torch.stack([x[i // k] for i in order])
    row_idx = torch.empty(len(flat), dtype=torch.int32)
    for pos, i in enumerate(order):
        row_idx[i] = pos
    counts = torch.bincount(torch.tensor(flat), minlength=3).to(torch.int64)
    return expanded_x, row_idx, counts  # expanded_scale is meaningless without a scale


def _unpermute():
    permuted = torch.randn(6, 8, generator=_g(10)).bfloat16()
    sorted_indices = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    probs = torch.rand(3, 2, generator=_g(11)).bfloat16()
    return (permuted, sorted_indices, probs), {}


def _unpermute_golden(permuted, sorted_indices, probs):
    t = permuted.double()[sorted_indices.long()].reshape(3, 2, -1) * probs.double().unsqueeze(-1)
    return t.sum(dim=1).to(permuted.dtype)


def _dequant_swiglu():
    x = torch.randint(-10, 10, (6, 256), generator=_g(12), dtype=torch.int32)
    ws = torch.rand(2, 256, generator=_g(13)) * 0.01
    act = torch.rand(6, generator=_g(14))
    return (x,), {"weight_scale": ws, "activation_scale": act, "group_index": torch.tensor([2, 4]),
                  "activate_left": True, "quant_mode": 1}


def _dequant_swiglu_golden(x, weight_scale, activation_scale, group_index, activate_left, quant_mode):
    rows = []
    start = 0
    for g, c in enumerate(group_index.tolist()):
        d = x[start:start + c].double() * weight_scale[g].double() * activation_scale[start:start + c].double().unsqueeze(-1)
        a, b = d.chunk(2, dim=-1)
        rows.append(_swish(a) * b)
        start += c
    return _dq_rows(torch.cat(rows))


def _gmm_swiglu_quant():
    x = torch.randint(-4, 4, (6, 32), generator=_g(15), dtype=torch.int8)
    w = torch.randint(-4, 4, (2, 32, 16), generator=_g(16), dtype=torch.int8)
    return (x, w, torch.tensor([2, 6], dtype=torch.int64), torch.rand(2, 16, generator=_g(17)) * 0.1,
            torch.rand(6, generator=_g(18))), {}


def _gmm_swiglu_quant_golden(x, w, group_list, weight_scale, x_scale):
    rows, start = [], 0
    for e, end in enumerate(group_list.tolist()):
        c = (x[start:end].double() @ w[e].double()) * x_scale[start:end].double().unsqueeze(-1) * weight_scale[e].double()
        a, gate = c.chunk(2, dim=-1)
        rows.append(_swish(a) * gate)
        start = end
    q, s = _dq_rows(torch.cat(rows))
    return q, s


def _swiglu():
    return (torch.randn(2, 32, 6, 6, generator=_g(19)),), {"dim": -1}  # the page's example shape


def _swiglu_golden(x, dim):
    a, b = x.double().chunk(2, dim=dim)
    return (_swish(a) * b).to(x.dtype)


def _gating_softmax():
    return (torch.randn(5, 8, generator=_g(20)).half(),), {"k": 2}


def _gating_softmax_golden(x, k):
    p = torch.softmax(x.double(), dim=-1)
    v, i = p.topk(k, dim=-1)
    return v.to(x.dtype), i.to(torch.int32)


# --------------------------------------------------------------------------- DeepSeek shared experts
# the current line's vllm-ascend INT8 shared-experts path (`op_rules`, "DeepSeek shared experts"): the int32
# output of npu_quant_matmul and vllm-ascend's own _C_ascend.npu_dequant_swiglu_quant, swiglu_mode 1.

def _quant_matmul_int32():
    x1 = torch.randint(-128, 128, (7, 96), generator=_g(30), dtype=torch.int8)
    x2 = torch.randint(-128, 128, (96, 48), generator=_g(31), dtype=torch.int8)
    scale = torch.rand(48, generator=_g(32)) * 0.01  # fp32: vllm-ascend's weight_scale
    return (x1, x2, scale), {"pertoken_scale": None, "bias": None, "output_dtype": torch.int32}


def _quant_matmul_int32_golden(x1, x2, scale, pertoken_scale=None, bias=None, output_dtype=None):
    # the unscaled int32 accumulator (see reference.npu_quant_matmul: NOT VERIFIED ON HARDWARE)
    return (x1.long() @ x2.long()).to(torch.int32)


def _dsq_mode1(clamp_limit=0.0, glu_alpha=1.0, glu_bias=0.0):
    def build():
        x = torch.randint(-400, 400, (5, 192), generator=_g(33), dtype=torch.int32)
        ws = torch.rand(192, generator=_g(34)) * 0.01
        act = torch.rand(5, generator=_g(35)) * 0.05
        return (x,), {"weight_scale": ws, "activation_scale": act, "group_index": torch.tensor([5]),
                      "activate_left": True, "quant_mode": 1, "swiglu_mode": 1,
                      "clamp_limit": clamp_limit, "glu_alpha": glu_alpha, "glu_bias": glu_bias}
    return build


def _dsq_mode1_golden(x, weight_scale, activation_scale, group_index, activate_left, quant_mode,
                      swiglu_mode, clamp_limit, glu_alpha, glu_bias):
    d = x.double() * weight_scale.double() * activation_scale.double().unsqueeze(-1)
    glu, lin = d.chunk(2, dim=-1)  # halves, as the current line's vllm-ascend kernel reads them
    if clamp_limit > 0:
        glu, lin = glu.clamp(max=clamp_limit), lin.clamp(-clamp_limit, clamp_limit)
    return _dq_rows(glu * torch.sigmoid(glu_alpha * glu) * (lin + glu_bias))


CASES: List[Case] = [
    Case("npu_dynamic_quant", "page example (3, 3) fp16", _dynamic_quant,
         lambda x: _dq_rows(x.float())),
    Case("npu_dynamic_quant", "float32 x (refused)", lambda: ((torch.rand(3, 3),), {}), valid=False),
    Case("npu_quantize", "page example (1, 1, 12) bf16, div_mode False", _quantize,
         lambda x, s, zp, dt, axis, div: torch.round(x.double() * s.double()).clamp(-128, 127).to(torch.int8)),
    Case("npu_quantize", "zero_points dtype differs from scales (refused)",
         lambda: ((torch.randn(2, 4).bfloat16(), torch.ones(4).bfloat16(), torch.zeros(4, dtype=torch.int8),
                   torch.qint8, -1, False), {}), valid=False),
    Case("npu_quant_matmul", "per-token, bf16 scale -> bf16", _quant_matmul_pertoken, _quant_matmul_golden),
    Case("npu_quant_matmul", "fp16 scale with per-token scale -> fp16 (refused)",
         _quant_matmul_fp16_half_scale, valid=False),
    Case("npu_grouped_matmul", "per-token int8, counts, bf16 scale -> bf16", _gmm_pertoken(), _gmm_golden),
    Case("npu_grouped_matmul", "group_list sums to fewer than M (EP all-gather; refused)",
         _gmm_pertoken(rows_covered=6), valid=False),
    Case("npu_moe_init_routing_v2", "npu_moe_init_routing's page example, count mode", _init_routing,
         _init_routing_golden),
    Case("npu_moe_init_routing_v2", "int64 expert_idx (refused)",
         lambda: ((torch.rand(3, 4), torch.zeros(3, 2, dtype=torch.int64)),
                  {**_init_routing()[1]}), valid=False),
    Case("npu_moe_token_unpermute", "bf16, top-2", _unpermute, _unpermute_golden),
    Case("npu_moe_token_unpermute", "int64 sorted_indices (refused)",
         lambda: ((torch.randn(2, 4).bfloat16(), torch.arange(2)), {}), valid=False),
    Case("npu_dequant_swiglu_quant", "int32 x, 2 groups, H=128", _dequant_swiglu, _dequant_swiglu_golden),
    Case("npu_grouped_matmul_swiglu_quant", "NZ int8 weight, 2 experts", _gmm_swiglu_quant,
         _gmm_swiglu_quant_golden, nz_args=(1,)),
    Case("npu_grouped_matmul_swiglu_quant", "ND int8 weight (refused)", _gmm_swiglu_quant, valid=False),
    Case("npu_swiglu", "page example (2, 32, 6, 6) fp32", _swiglu, _swiglu_golden),
    Case("npu_moe_gating_top_k_softmax", "fp16, k=2", _gating_softmax, _gating_softmax_golden),
    Case("npu_quant_matmul@int32", "int32 output (the unscaled accumulator)", _quant_matmul_int32,
         _quant_matmul_int32_golden),
    Case("npu_quant_matmul@int32", "int32 output with pertoken_scale (refused)",
         lambda: (_quant_matmul_int32()[0], {**_quant_matmul_int32()[1], "pertoken_scale": torch.ones(7)}),
         valid=False),
    Case("_C_ascend.npu_dequant_swiglu_quant", "swiglu_mode 1, no clamp (DeepSeek's shared experts)",
         _dsq_mode1(), _dsq_mode1_golden),
    Case("_C_ascend.npu_dequant_swiglu_quant", "swiglu_mode 1, clamp 7, alpha 1.702, bias 1",
         _dsq_mode1(7.0, 1.702, 1.0), _dsq_mode1_golden),
    Case("_C_ascend.npu_dequant_swiglu_quant", "swiglu_mode 2 (refused)",
         lambda: (_dsq_mode1()()[0], {**_dsq_mode1()()[1], "swiglu_mode": 2}), valid=False),
]



# --------------------------------------------------------------------------- W4A8 (int4) cases
# The golden packing is the op page's "8 int4 per int32" with the nibble order kernels/int4.py
# states (element 8j+i in bits 4i..4i+3): on a device this row is what checks that order.

def _int4_golden_pack(w):
    out = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        out |= (w[:, i::8].long() & 0xF) << (4 * i)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def _int4pack():
    # the page's example: randint(-8, 8, (k=64, n=32)) int32
    return (torch.randint(-8, 8, (64, 32), generator=_g(21), dtype=torch.int32),), {}


def _wqbmm_page_example():
    # the int4pack page's call: fp16 x (128, 64), int4 weight (64, 32), (1, n) scale and offset
    x = torch.randn(128, 64, generator=_g(22)).half()
    w = torch.randint(-8, 8, (64, 32), generator=_g(23), dtype=torch.int32)
    scale = (torch.rand(1, 32, generator=_g(24)) * 0.1).half()
    offset = torch.randn(1, 32, generator=_g(25)).half()
    return (x, _int4_golden_pack(w), scale, offset), {}


def _wqbmm_per_group():
    # vllm-ascend's W4A8_DYNAMIC call: bf16 x, int4 weight [K, N/8], scale (K / 32, N) bf16
    x = torch.randn(5, 64, generator=_g(26)).bfloat16()
    w = torch.randint(-8, 8, (64, 16), generator=_g(27), dtype=torch.int32)
    scale = (torch.rand(2, 16, generator=_g(28)) * 0.1).bfloat16()
    return (x, _int4_golden_pack(w), scale), {"antiquant_group_size": 32}


def _unpack_golden(packed):
    w = packed.long() & 0xFFFFFFFF
    cols = [((w >> (4 * i)) & 0xF) for i in range(8)]
    nib = torch.stack(cols, dim=-1).reshape(packed.shape[0], -1)
    return torch.where(nib >= 8, nib - 16, nib)


def _wqbmm_golden(x, w, antiquant_scale, antiquant_offset=None, antiquant_group_size=0):
    q = _unpack_golden(w).double()
    s = antiquant_scale.double()
    o = antiquant_offset.double() if antiquant_offset is not None else torch.zeros_like(s)
    if antiquant_group_size:
        s = s.repeat_interleave(antiquant_group_size, dim=0)
        o = o.repeat_interleave(antiquant_group_size, dim=0)
    return (x.double() @ ((q + o) * s)).to(x.dtype)


CASES += [
    Case("npu_convert_weight_to_int4pack", "page example (64, 32) int32", _int4pack,
         _int4_golden_pack),
    Case("npu_convert_weight_to_int4pack", "a value outside [-8, 7] (refused)",
         lambda: ((torch.full((2, 8), 8, dtype=torch.int32),), {}), valid=False),
    Case("npu_convert_weight_to_int4pack", "last dim not a multiple of 8 (refused)",
         lambda: ((torch.zeros(2, 12, dtype=torch.int32),), {}), valid=False),
    Case("npu_weight_quant_batchmatmul", "int4 page example, fp16, per-channel scale + offset",
         _wqbmm_page_example, _wqbmm_golden),
    Case("npu_weight_quant_batchmatmul", "int4 per-group (32) bf16, vllm-ascend's W4A8 call",
         _wqbmm_per_group, _wqbmm_golden),
    Case("npu_weight_quant_batchmatmul", "float32 antiquant_scale with a bf16 x (refused)",
         lambda: ((_wqbmm_per_group()[0][0], _wqbmm_per_group()[0][1], _wqbmm_per_group()[0][2].float()),
                  {"antiquant_group_size": 32}), valid=False),
]



# --------------------------------------------------------------------------- W4A8 fused-MoE cases
# vllm-ascend's W4A8_DYNAMIC fused MoE: the experts packed by npu_quantize(quint4x2) (the page's
# "8 int4 per int32", with kernels/int4.py's nibble order: on a device this row checks it) and
# the A8W4 grouped matmul (aclnnGroupedMatmulV4's formula, taken literally here).

def _quantize_quint4x2():
    # vllm-ascend's call: fp32 int4 values, scale tensor([1.0]), axis -1, div_mode False
    w = torch.randint(-8, 8, (2, 4, 16), generator=_g(31)).float()
    return (w, torch.tensor([1.0]), None, torch.quint4x2, -1, False), {}


def _quantize_quint4x2_golden(x, scales, zero_points, dtype, axis, div_mode):
    flat = x.reshape(-1, x.shape[-1]).round().clamp(-8, 7).to(torch.int32)
    return _int4_golden_pack(flat).reshape(*x.shape[:-1], x.shape[-1] // 8)


def _fp32_bits_as_int64(s: torch.Tensor) -> torch.Tensor:
    return s.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _gmm_a8w4(k: int = 256):
    def build():
        e, n, m = 2, 16, 5
        x = torch.randint(-128, 128, (m, k), generator=_g(32), dtype=torch.int8)
        w = torch.randint(-8, 8, (e, k, n), generator=_g(33), dtype=torch.int32)
        s = (torch.rand(e, max(k // 256, 1), n, generator=_g(34)) * 0.01).half().float()
        bias = 8 * (w.double() * s.double().repeat_interleave(256, dim=1)[:, :k]).sum(dim=1)
        packed = torch.stack([_int4_golden_pack(w[i]) for i in range(e)])
        pts = torch.rand(m, generator=_g(35))
        return ([x], [packed]), {"bias": [bias.float()], "scale": [_fp32_bits_as_int64(s)],
                                 "per_token_scale": [pts], "group_list": torch.tensor([3, 2]),
                                 "split_item": 2, "group_type": 0, "group_list_type": 1,
                                 "output_dtype": torch.bfloat16}
    return build


def _gmm_a8w4_golden(x, w, bias, scale, per_token_scale, group_list, **_):
    # y_i = ((x_i - 8) @ (weight_i * scale_i) + bias_i) * per_token_scale_i
    xs, p, b = x[0].double(), per_token_scale[0].double(), bias[0].double()
    s = (scale[0] & 0xFFFFFFFF).to(torch.int32).view(torch.float32).double()
    out = torch.zeros(xs.shape[0], s.shape[2], dtype=torch.float64)
    start = 0
    for i, c in enumerate(group_list.tolist()):
        wi = _unpack_golden(w[0][i]).double() * s[i].repeat_interleave(256, dim=0)
        out[start:start + c] = ((xs[start:start + c] - 8) @ wi + b[i]) * p[start:start + c].unsqueeze(-1)
        start += c
    return [out.to(torch.bfloat16)]


CASES += [
    Case("npu_quantize@quint4x2", "int4 values (2, 4, 16) fp32, scale 1.0 (vllm-ascend's W4A8 MoE packing)",
         _quantize_quint4x2, _quantize_quint4x2_golden),
    Case("npu_quantize@quint4x2", "last dim not a multiple of 8 (refused)",
         lambda: ((torch.zeros(2, 12), torch.tensor([1.0]), None, torch.quint4x2, -1, False), {}),
         valid=False),
    Case("npu_grouped_matmul@A8W4", "int8 x, int4 weight (2, 256, 16), per-group uint64 scale, counts",
         _gmm_a8w4(), _gmm_a8w4_golden),
    Case("npu_grouped_matmul@A8W4", "K=128, not a multiple of quantGroupSize 256 (refused)",
         _gmm_a8w4(128), valid=False),
]


# --------------------------------------------------------------------------- running

def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _flat(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def compare(got, want) -> Optional[str]:
    """None when `got` matches `want` within the tolerances above, else what differs."""
    g, w = _flat(got), _flat(want)
    for i, (a, b) in enumerate(zip(g, w)):
        a = a.detach().cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {a.dtype} {tuple(a.shape)}, expected {b.dtype} {tuple(b.shape)}"
        if not b.is_floating_point():
            diff = int((a.long() - b.long()).abs().max()) if a.numel() else 0
            tol = INT8_ABS_TOL if b.dtype == torch.int8 else 0
            if diff > tol:
                return f"output {i}: integer difference {diff} > {tol}"
            continue
        rtol = _FLOAT_ULPS.get(b.dtype, SCALE_RTOL)
        if not torch.allclose(a.double(), b.double(), rtol=rtol, atol=rtol * float(b.double().abs().max() or 1.0) * 1e-3):
            err = float(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max())
            return f"output {i}: relative difference {err:.3g} > {rtol:.3g}"
    return None


def torch_npu_module():
    """The real torch_npu when one is importable, else the emulation (installed here)."""
    from npu_flashrl.kernels import emulation

    if emulation.real_torch_npu_importable():
        import torch_npu  # noqa: F401  (real)

        return torch_npu, "npu"
    emulation.install()
    import torch_npu  # the emulation

    return torch_npu, "cpu"


def resolve_op(case_op: str, torch_npu, device: str):
    """The callable a case names: `torch_npu.<op>` (an `@<variant>` suffix only names the case's
    row), or vllm-ascend's compiled `torch.ops._C_ascend.<op>` for an `_C_ascend.` name (the
    emulation's CPU kernel here, vllm-ascend's custom ops on an NPU host)."""
    op = case_op.split("@", 1)[0]
    if not op.startswith("_C_ascend."):
        return getattr(torch_npu, op)
    if device == "cpu":
        from npu_flashrl.kernels import emulation

        emulation.register_cpu_ops()
    else:
        from vllm_ascend.utils import enable_custom_op

        enable_custom_op()
    return getattr(torch.ops._C_ascend, op.split(".", 1)[1])


def run_case(case: Case, torch_npu, device: str) -> Tuple[str, str]:
    args, kwargs = case.build()
    dev_args, dev_kwargs = _to(args, device), _to(kwargs, device)
    if case.nz_args:
        dev_args = list(dev_args)
        for i in case.nz_args:
            dev_args[i] = torch_npu.npu_format_cast(dev_args[i], 29)
    try:
        got = resolve_op(case.op, torch_npu, device)(*dev_args, **dev_kwargs)
    except Exception as exc:  # noqa: BLE001  (a device refusal is a result)
        if not case.valid:
            # the emulation must refuse by the documented rule, not by some other failure
            if device == "cpu" and not isinstance(exc, ValueError):
                return DIFFERS, f"refused, but not by a documented rule: {type(exc).__name__}: {exc}"
            return MATCHES, f"refused as documented ({type(exc).__name__})"
        return REFUSED, f"{type(exc).__name__}: {str(exc)[:200]}"
    if not case.valid:
        return ACCEPTS_INVALID, "accepted an input the page rejects (the page is stricter than the device)"
    why = compare(got if case.op != "npu_moe_init_routing_v2" else got[:3], case.golden(*args, **kwargs))
    return (DIFFERS, why) if why else (MATCHES, "within tolerance")


def run(cases: Optional[List[Case]] = None) -> List[Dict[str, str]]:
    """One row per op: {op, status, detail, device}. status is the worst of its cases
    (differs > refused by device > accepts invalid > matches)."""
    torch_npu, device = torch_npu_module()
    rank = {MATCHES: 0, ACCEPTS_INVALID: 1, REFUSED: 2, DIFFERS: 3}
    rows: Dict[str, Dict[str, str]] = {}
    for case in cases if cases is not None else CASES:
        status, detail = run_case(case, torch_npu, device)
        row = rows.setdefault(case.op, {"op": case.op, "status": MATCHES, "detail": "", "device": device})
        if rank[status] > rank[row["status"]]:
            row["status"] = status
        row["detail"] += ("; " if row["detail"] else "") + f"{case.name}: {status} ({detail})"
    return list(rows.values())


def failed(rows: List[Dict[str, str]]) -> bool:
    """A difference or a device refusal of a documented-valid input fails the run."""
    return any(r["status"] in (DIFFERS, REFUSED) for r in rows)


def format_rows(rows: List[Dict[str, str]]) -> str:
    w = max(len(r["op"]) for r in rows)
    s = max(len(r["status"]) for r in rows)
    lines = [f"{'OP'.ljust(w)}  {'RESULT'.ljust(s)}  DETAIL ({rows[0]['device'] if rows else ''})"]
    lines += [f"{r['op'].ljust(w)}  {r['status'].ljust(s)}  {r['detail']}" for r in rows]
    return "\n".join(lines)
