"""The emulated ops of vllm-ascend 0.23's INT8 shared-experts path (DeepSeek-V3's MoE layers):
`torch_npu.npu_quant_matmul` with an int32 output and vllm-ascend's own
`torch.ops._C_ascend.npu_dequant_swiglu_quant` with swiglu_mode 1, each against a golden computed
here from the documented formula, and the documented refusals (naming the op, the argument and
the page).

Stand-ins: the emulated torch_npu / _C_ascend ops (`kernels.emulation`), the subject here (no NPU)."""
import pytest
import torch

from npu_flashrl.kernels import dequant_swiglu_v2, emulation, op_rules, reference


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def c_ascend():
    emulation.register_cpu_ops()
    return torch.ops._C_ascend


def test_int32_output_is_the_exact_unscaled_accumulator():
    x1 = torch.randint(-128, 128, (5, 300), generator=_g(0), dtype=torch.int8)
    x2 = torch.randint(-128, 128, (300, 40), generator=_g(1), dtype=torch.int8)
    bias = torch.randint(-1000, 1000, (40,), generator=_g(2), dtype=torch.int32)
    for scale in (torch.rand(40) * 0.01, (torch.rand(40) * 0.01).bfloat16()):
        out = reference.npu_quant_matmul(x1, x2, scale, bias=bias, output_dtype=torch.int32)
        assert out.dtype == torch.int32
        assert torch.equal(out.long(), x1.long() @ x2.long() + bias.long())


@pytest.mark.parametrize("kw, arg", [
    ({"pertoken_scale": torch.ones(5)}, "scale/offset/bias/pertoken_scale"),   # table 2: no pertoken row
    ({"bias": torch.zeros(40, dtype=torch.bfloat16)}, "scale/offset/bias/pertoken_scale"),
    ({"offset": torch.zeros(40)}, "scale/offset/bias/pertoken_scale"),
])
def test_int32_output_refuses_what_table_2_does_not_list(kw, arg):
    x1 = torch.zeros(5, 16, dtype=torch.int8)
    x2 = torch.zeros(16, 40, dtype=torch.int8)
    with pytest.raises(op_rules.OpRuleError) as e:
        reference.npu_quant_matmul(x1, x2, torch.ones(40), output_dtype=torch.int32, **kw)
    assert str(e.value).startswith(f"torch_npu.npu_quant_matmul: {arg}: ")
    assert "int32 output" in str(e.value) and op_rules.DOC["npu_quant_matmul"] in str(e.value)


def test_int8_output_stays_not_emulated():
    with pytest.raises(NotImplementedError, match="int8 output is not emulated"):
        reference.npu_quant_matmul(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(4, 3, dtype=torch.int8),
                                   torch.ones(3), output_dtype=None)


def _golden(x, ws, act, activate_left=True, mode=0, clamp=0.0, alpha=1.0, bias=0.0):
    d = x.double() * ws.double() * act.double().unsqueeze(-1)
    left, right = d.chunk(2, dim=-1)
    a, b = (left, right) if activate_left else (right, left)
    if mode == 1 and clamp > 0:
        a, b = a.clamp(max=clamp), b.clamp(-clamp, clamp)
    y = a * torch.sigmoid((alpha if mode == 1 else 1.0) * a) * (b + (bias if mode == 1 else 0.0))
    s = y.abs().amax(-1) / 127
    return torch.round(y / s.unsqueeze(-1)).clamp(-128, 127).to(torch.int8), s.float()


def _inputs(t=6, h2=192):
    return (torch.randint(-500, 500, (t, h2), generator=_g(3), dtype=torch.int32),
            torch.rand(h2, generator=_g(4)) * 0.01, torch.rand(t, generator=_g(5)) * 0.05)


@pytest.mark.parametrize("mode, clamp, alpha, bias", [(1, 0.0, 1.0, 0.0), (1, 0.05, 1.702, 1.0), (0, 0.0, 1.0, 0.0)])
def test_c_ascend_dequant_swiglu_quant_modes(c_ascend, mode, clamp, alpha, bias):
    """swiglu_mode 1 as vllm-ascend 0.23's shared experts call it (clamp 0.0: off; alpha 1, bias 0)
    is swish(left half) * right half; with a clamp, alpha and bias it is the page's variant
    formula (a clamp of 0.05 changes values here: the dequantized x spans about +-0.25)."""
    x, ws, act = _inputs()
    q, s = c_ascend.npu_dequant_swiglu_quant(
        x, weight_scale=ws, activation_scale=act, group_index=torch.tensor([6]), activate_left=True,
        quant_mode=1, swiglu_mode=mode, clamp_limit=clamp, glu_alpha=alpha, glu_bias=bias)
    wq, wsc = _golden(x, ws, act, mode=mode, clamp=clamp, alpha=alpha, bias=bias)
    assert (q.long() - wq.long()).abs().max() <= 1  # Huawei's int8 tolerance (conformance.py)
    assert torch.allclose(s, wsc, rtol=1e-4)
    if clamp:
        unclamped, _ = _golden(x, ws, act, mode=1, alpha=alpha, bias=bias)
        assert (unclamped.long() - wq.long()).abs().max() > 1  # the clamp is exercised


def test_c_ascend_dequant_swiglu_quant_groups_and_leftover_rows(c_ascend):
    x, _, act = _inputs(t=7)
    ws = torch.rand(2, 192, generator=_g(6)) * 0.01
    q, s = c_ascend.npu_dequant_swiglu_quant(x, weight_scale=ws, activation_scale=act,
                                             group_index=torch.tensor([2, 3]), quant_mode=1)
    q0, _ = _golden(x[:2], ws[0], act[:2])
    q1, _ = _golden(x[2:5], ws[1], act[2:5])
    assert (q[:5].long() - torch.cat([q0, q1]).long()).abs().max() <= 1
    assert not q[5:].any() and not s[5:].any()


@pytest.mark.parametrize("change, arg", [
    ({"swiglu_mode": 2}, "swiglu_mode"),
    ({"clamp_limit": -1.0}, "clamp_limit"),
    ({"glu_alpha": float("inf")}, "glu_alpha/glu_bias"),
    ({"swiglu_mode": 1, "activate_left": False}, "activate_left"),
    ({"activation_scale": torch.ones(6, 1)}, "activation_scale"),
    ({"weight_scale": None}, "weight_scale"),
    ({"weight_scale": torch.ones(192, dtype=torch.bfloat16)}, "weight_scale"),
    ({"group_index": torch.tensor([7])}, "group_index"),
    ({"group_index": torch.tensor([6], dtype=torch.int32)}, "group_index"),
    ({"quant_mode": 2}, "quant_mode"),
])
def test_c_ascend_dequant_swiglu_quant_refusals(c_ascend, change, arg):
    x, ws, act = _inputs()
    kw = dict(weight_scale=ws, activation_scale=act, group_index=torch.tensor([6]), activate_left=True,
              quant_mode=1, swiglu_mode=1)
    kw.update(change)
    with pytest.raises(op_rules.OpRuleError) as e:
        c_ascend.npu_dequant_swiglu_quant(x, **kw)
    msg = str(e.value)
    assert msg.startswith(f"torch.ops._C_ascend.npu_dequant_swiglu_quant: {arg}: "), msg
    assert "(documented: https://" in msg


def test_not_emulated_modes_say_so(c_ascend):
    x, ws, act = _inputs()
    with pytest.raises(NotImplementedError, match="quant_scale"):
        dequant_swiglu_v2.npu_dequant_swiglu_quant(x, weight_scale=ws, activation_scale=act, quant_mode=1,
                                                   quant_scale=torch.ones(96))


@pytest.fixture
def tn():
    was = emulation.is_installed()
    emulation.install()
    import torch_npu  # the emulation

    yield torch_npu
    if not was:
        emulation.uninstall()


def test_shared_experts_chain_equals_a_float_golden(c_ascend, tn):
    """The four calls vllm-ascend 0.23 makes for INT8 shared experts (`_forward_shared_experts`):
    dynamic quant, int32 gate_up matmul, dequant + swiglu_mode 1 + quant, down matmul; against the
    same MLP in float64 on the dequantized int8 weights (within INT8 activation error)."""
    t, hidden, inter = 9, 128, 96
    x = torch.randn(t, hidden, generator=_g(7)).bfloat16()
    w13 = torch.randint(-127, 128, (hidden, 2 * inter), generator=_g(8), dtype=torch.int8)
    s13 = torch.rand(2 * inter, generator=_g(9)) * 0.002 + 0.001
    w2 = torch.randint(-127, 128, (inter, hidden), generator=_g(10), dtype=torch.int8)
    s2 = (torch.rand(hidden, generator=_g(11)) * 0.002 + 0.001).bfloat16()
    qx, ps = tn.npu_dynamic_quant(x)
    h = tn.npu_quant_matmul(qx, w13, s13.bfloat16(), pertoken_scale=None, bias=None, output_dtype=torch.int32)
    gi = torch.tensor([t], dtype=torch.int64)
    qh, hs = c_ascend.npu_dequant_swiglu_quant(x=h, weight_scale=s13, activation_scale=ps, group_index=gi,
                                               activate_left=True, quant_mode=1, swiglu_mode=1, clamp_limit=0.0)
    out = tn.npu_quant_matmul(qh, w2, s2, pertoken_scale=hs, bias=None, output_dtype=torch.bfloat16)
    # the same four steps in float64, quantizing as the pages say (rowmax / 127, round half even)
    def quant(y):
        sc = y.abs().amax(-1, keepdim=True) / 127
        return torch.round(y / sc).clamp(-128, 127), sc

    q1, sc1 = quant(x.double())
    g, u = ((q1 @ w13.double()) * sc1 * s13.double()).chunk(2, dim=-1)
    q2, sc2 = quant(g * torch.sigmoid(g) * u)
    want = (q2 @ w2.double()) * sc2 * s2.double()
    err = ((out.double() - want).norm() / want.norm()).item()
    # bf16 output rounding (2^-9) and an int8 tie rounded the other way at most
    assert err < 4e-3, err
    # and the dequantized-weight MLP in float64 (unquantized activations) is near
    gf, uf = (x.double() @ (w13.double() * s13.double())).chunk(2, dim=-1)
    ref = (gf * torch.sigmoid(gf) * uf) @ (w2.double() * s2.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.05
