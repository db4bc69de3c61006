"""The REAL vllm-ascend W8A8 linear methods on a CPU layer, with emulated torch_npu.

Runs on every stack line (v0.10.1rc1 / 0.11.0: `quantization/w8a8*.py`; 0.23: `methods/`, picked
through the scheme registry). Stand-ins: torch_npu (reference kernels, npu_flashrl.kernels) and,
on 0.23, a CPU kernel for vllm-ascend's NPU-only `vllm::quantize` op (the same reference body).

`AscendLinearMethod` (which wraps `AscendW8A8LinearMethod` / `AscendW8A8DynamicLinearMethod`
according to the quant description) runs create_weights -> (we load int8 weights and scales from
a per-channel quantization of a random bf16 weight) -> process_weights_after_loading -> apply,
and the output is compared with the float reference x @ W^T (+ bias).

Tolerance: an int8 symmetric per-channel weight has a rounding step of absmax/127 per row; for
Gaussian rows (absmax ~ 3 sigma at these widths) the rms rounding error is step/sqrt(12), about
0.7% of the weights' rms. The int8 activation (per-token for the dynamic method, per-tensor
asymmetric for the static one) adds a similar independent error, and rounding the output to
bf16/fp16 adds at most 0.4% (bf16 epsilon/2). Together that is ~1e-2 relative (measured
upstream: 0.8-0.9% per layer), so we accept a relative Frobenius error below REL_TOL = 2.5e-2.
A missing bias or an unapplied scale gives errors of order 1 (asserted below where it matters).
"""
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_ascend")

from npu_flashrl import lines
from npu_flashrl.sim import ascend_harness  # noqa: E402
from npu_flashrl.kernels import reference as ref  # noqa: E402

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line

REL_TOL = 2.5e-2
IN, OUT, TOKENS = 256, 96, 24


@pytest.fixture(scope="module")
def ascend(tmp_path_factory):
    """Emulation + CPU platform, a current vLLM config, the TP group and vllm-ascend's config.

    Creating vLLM parameters reads the TP rank, and 0.11.0's ascend config must be initialised;
    this follows CpuVllm.__enter__. The process group is shared with other tests (created once).
    """
    from npu_flashrl.sim.cpu_vllm import ensure_distributed, make_vllm_config, prepare_process
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    prepare_process(enable_nz=True)
    from vllm.config import set_current_vllm_config

    model_dir = str(tmp_path_factory.mktemp("tiny_qwen2_cfg"))
    build_tiny_qwen2(model_dir, tokenizer=False)
    cfg = make_vllm_config(model_dir)
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()
    try:
        ensure_distributed(1)
        ascend_harness.init_vllm_ascend_config(cfg)
        ln = lines.current()
        yield (ln.linear_wrapper_class(), ln.method_class("W8A8", "linear"),
               ln.method_class("W8A8_DYNAMIC", "linear"))
    finally:
        ctx.__exit__(None, None, None)


@pytest.fixture
def nz(request, monkeypatch, ascend):
    """Set vllm-ascend's NZ flag for one test (restored afterwards). Lines without the flag
    (v0.10.1rc1 always NZ-casts, per its line) run only the NZ case."""
    target = ascend_harness.nz_flag_target()
    if target is None:
        if not request.param:
            pytest.skip(f"vllm-ascend {lines.current().name} always NZ-casts W8A8 weights")
        assert ascend_harness.nz_enabled()
        return True
    monkeypatch.setattr(*target, request.param)
    return request.param


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def _random_weight(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # per-row spread like trained LLM weights, so per-channel scales really differ
    w = torch.randn(OUT, IN, generator=g) * 0.05 * torch.empty(OUT, 1).log_normal_(0.0, 0.5, generator=g)
    x = torch.randn(TOKENS, IN, generator=g)
    bias = torch.randn(OUT, generator=g)
    return w.to(dtype), x.to(dtype), bias


def _make_layer(ascend, quant_type, dtype):
    """A vLLM linear layer built through vllm-ascend's "ascend" quant config, as a model gets it:
    the config picks the method for the description's quant type and creates its weights."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    AscendLinearMethod, _, _ = ascend
    config = lines.current().quant_config_class()({"layer.weight": quant_type})
    config.packed_modules_mapping = {}  # what vLLM's configure_quant_config sets for a model
    layer = ReplicatedLinear(IN, OUT, bias=False, params_dtype=dtype, quant_config=config,
                             prefix="layer")
    assert isinstance(layer.quant_method, AscendLinearMethod)
    return layer.quant_method, layer


def _load(layer, **tensors):
    for name, value in tensors.items():
        p = getattr(layer, name)
        assert p.shape == value.shape, name
        p.data.copy_(value.to(p.dtype))


# --------------------------------------------------------------------------- dynamic (W8A8_DYNAMIC)

@pytest.mark.parametrize("nz", [True, False], indirect=True, ids=["nz", "nd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_method_matches_float_reference(ascend, nz, dtype):
    _, _, Dyn = ascend
    method, layer = _make_layer(ascend, "W8A8_DYNAMIC", dtype)
    assert type(method.quant_method) is Dyn
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (OUT, IN)
    assert layer.weight_scale.shape == (OUT, 1) and layer.weight_scale.dtype == dtype
    assert layer.weight_offset.shape == (OUT, 1)

    w, x, bias = _random_weight(dtype, seed=0)
    q, s = ref.quantize_weight_per_channel(w)
    _load(layer, weight=q, weight_scale=s.reshape(OUT, 1), weight_offset=torch.zeros(OUT, 1))
    method.process_weights_after_loading(layer)

    # after loading: [in, out] int8, NZ cast when enabled, flattened scales, fp32 scale copy
    assert layer.weight.shape == (IN, OUT) and layer.weight.dtype == torch.int8
    assert torch.equal(layer.weight.data, q.t())
    assert ref.get_npu_format(layer.weight.data) == (29 if nz else 2)
    assert layer.weight_scale.shape == (OUT,) and layer.weight_offset.shape == (OUT,)
    assert layer.weight_scale_fp32.dtype == torch.float32
    assert torch.equal(layer.weight_scale_fp32, layer.weight_scale.data.float())

    if dtype == torch.float16:
        # vllm-ascend passes the float16 weight_scale with a per-token scale: the documented op
        # refuses it (a float16 output with a per-token scale takes a float32 scale), which is
        # why npu_flashrl refuses a float16 INT8 rollout (config.int8_rollout_dtype_problem)
        from npu_flashrl.kernels.op_rules import OpRuleError

        with pytest.raises(OpRuleError, match="npu_quant_matmul: scale: dtype must be one of float32"):
            method.apply(layer, x)
        return
    expected = x.float() @ w.float().t()
    out = method.apply(layer, x)
    assert out.dtype == dtype and out.shape == (TOKENS, OUT)
    assert _rel_err(out, expected) < REL_TOL

    # float bias: the dynamic method passes it to npu_quant_matmul, which adds it after scaling
    b = (bias * expected.std()).to(dtype)
    out_b = method.apply(layer, x, b)
    assert _rel_err(out_b, expected + b.float()) < REL_TOL
    assert _rel_err(out_b, expected) > 0.3  # the bias is large enough to be seen


@pytest.mark.parametrize("nz", [True], indirect=True)
def test_dynamic_method_wrong_scales_are_detected(ascend, nz):
    # The comparison has teeth: loading the int8 weight without its scales (all ones, what a
    # plain bf16 checkpoint would leave) is far outside the tolerance.
    method, layer = _make_layer(ascend, "W8A8_DYNAMIC", torch.bfloat16)
    w, x, _ = _random_weight(torch.bfloat16, seed=1)
    q, s = ref.quantize_weight_per_channel(w)
    _load(layer, weight=q, weight_scale=torch.ones(OUT, 1), weight_offset=torch.zeros(OUT, 1))
    method.process_weights_after_loading(layer)
    assert _rel_err(method.apply(layer, x), x.float() @ w.float().t()) > 1.0


# --------------------------------------------------------------------------- static (W8A8)

def _static_activation_params(x: torch.Tensor):
    """Asymmetric per-tensor int8 for x: scale ~ (max - min) / 255, offset maps min to -128.

    The scale is rounded up to a power of two so that it is exact in bf16/fp16 and so is the
    reciprocal that process_weights_after_loading computes in the params dtype: the deq_scale we
    build from it is then exactly the one the int8 activations were made with.
    """
    xf = x.float()
    lo, hi = xf.min().item(), xf.max().item()
    scale = 2.0 ** torch.ceil(torch.log2(torch.tensor((hi - lo) / 255.0))).item()
    offset = int(round(-128 - lo / scale))
    assert -128 <= offset <= 127
    return scale, offset


def _encode_deq_scale(deq: torch.Tensor, dtype) -> torch.Tensor:
    """vllm-ascend's deq_scale param: fp32 for bf16 models, int64 holding the fp32 bit pattern in
    its low 32 bits for fp16 models (what npu_trans_quant_param produces)."""
    if dtype == torch.bfloat16:
        return deq.float()
    return deq.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


@pytest.mark.parametrize("nz", [True, False], indirect=True, ids=["nz", "nd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_static_method_matches_float_reference_and_needs_bias_folding(ascend, nz, dtype):
    _, W8A8, _ = ascend
    method, layer = _make_layer(ascend, "W8A8", dtype)
    assert type(method.quant_method) is W8A8
    assert layer.quant_bias.dtype == torch.int32 and layer.quant_bias.shape == (OUT,)
    assert layer.deq_scale.dtype == (torch.float32 if dtype == torch.bfloat16 else torch.int64)
    assert layer.input_scale.shape == (1,) and layer.input_offset.dtype == torch.int8

    w, x, bias = _random_weight(dtype, seed=2)
    x = (x.float() + 0.7).to(dtype)  # skewed activations, so the input offset is not zero
    q, s = ref.quantize_weight_per_channel(w)
    in_scale, in_offset = _static_activation_params(x)
    assert in_offset != 0
    deq = in_scale * s  # fp32 [out]

    # Derivation of quant_bias from the apply path:
    #   x_q = round(x * (1/in_scale) + in_offset)            (npu_quantize, div_mode False)
    #   out = (x_q @ W_q^T + quant_bias) * deq_scale          (int32 bias BEFORE the scale)
    # With x ~ (x_q - in_offset) * in_scale and W ~ W_q * s:  x @ W^T + b
    #   = deq * (x_q @ W_q^T - in_offset * W_q.sum(1)) + b
    #   = deq * (x_q @ W_q^T + [round(b / deq) - in_offset * W_q.sum(1)])
    offset_term = in_offset * q.long().sum(1)
    b = (bias * (x.float() @ w.float().t()).std()).to(dtype)
    qbias_nobias = (-offset_term).to(torch.int32)
    qbias_folded = (torch.round(b.float() / deq).long() - offset_term).to(torch.int32)

    _load(layer, weight=q, weight_scale=s.reshape(OUT, 1), weight_offset=torch.zeros(OUT, 1),
          input_scale=torch.tensor([in_scale]), input_offset=torch.tensor([in_offset]),
          deq_scale=_encode_deq_scale(deq, dtype), quant_bias=qbias_nobias)
    method.process_weights_after_loading(layer)

    assert layer.weight.shape == (IN, OUT) and torch.equal(layer.weight.data, q.t())
    assert ref.get_npu_format(layer.weight.data) == (29 if nz else 2)
    assert layer.weight_scale.shape == (OUT,) and layer.weight_offset.shape == (OUT,)
    assert layer.aclnn_input_scale.shape == (IN,)
    assert (layer.aclnn_input_scale_reciprocal == 1.0 / in_scale).all()
    assert (layer.aclnn_input_offset == in_offset).all()

    expected = x.float() @ w.float().t()
    out = method.apply(layer, x)
    assert out.dtype == dtype and out.shape == (TOKENS, OUT)
    assert _rel_err(out, expected) < REL_TOL

    # A float bias handed to apply (what vLLM's linear layer does with layer.bias) is IGNORED
    # by the static method: the output is the bias-free product, far from x @ W^T + b.
    out_unfolded = method.apply(layer, x, b)
    assert torch.equal(out_unfolded, out)
    assert _rel_err(out_unfolded, expected + b.float()) > 0.3

    # Folded into quant_bias, the bias is there.
    layer.quant_bias.data.copy_(qbias_folded)
    out_folded = method.apply(layer, x, b)
    assert _rel_err(out_folded, expected + b.float()) < REL_TOL


@pytest.mark.parametrize("nz", [True], indirect=True)
def test_static_method_without_offset_correction_is_wrong(ascend, nz):
    # The input-offset term of quant_bias is needed: leaving quant_bias at 0 with a non-zero
    # input offset shifts every output by deq * in_offset * W_q.sum(1), far outside tolerance.
    method, layer = _make_layer(ascend, "W8A8", torch.bfloat16)
    w, x, _ = _random_weight(torch.bfloat16, seed=3)
    x = (x.float() + 0.7).to(torch.bfloat16)
    q, s = ref.quantize_weight_per_channel(w)
    in_scale, in_offset = _static_activation_params(x)
    _load(layer, weight=q, weight_scale=s.reshape(OUT, 1), weight_offset=torch.zeros(OUT, 1),
          input_scale=torch.tensor([in_scale]), input_offset=torch.tensor([in_offset]),
          deq_scale=in_scale * s, quant_bias=torch.zeros(OUT, dtype=torch.int32))
    method.process_weights_after_loading(layer)
    assert _rel_err(method.apply(layer, x), x.float() @ w.float().t()) > 0.3
