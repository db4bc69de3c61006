"""Weight streams read the way vLLM reads them, on every stack line: a tensor a generator yields
is not held by reference past the yield that gave it; Parameters (what `named_parameters()`
yields), sparse, meta and float64 tensors and vLLM's fused names are accepted correctly or refused
by name; a list call is checked whole before anything is written, its INT8-wire tensors included.
Whatever is refused leaves the model as it was (nothing written, not flagged).

Real vLLM Qwen2 + vllm-ascend W8A8 layers on the CPU (`cpu_vllm.CpuVllm`). Stand-ins: torch_npu
(the reference kernels of npu_flashrl.kernels.emulation), vLLM attention (plain causal SDPA).
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import state
from npu_flashrl.sim.tiny_models import build_tiny_qwen2

pytestmark = pytest.mark.every_line

IDS = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
K = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(cold checkpoint dir, the second model's trainer-side HF module)."""
    root = str(tmp_path_factory.mktemp("streams"))
    d0 = os.path.join(root, "w0")
    build_tiny_qwen2(d0, seed=0, tokenizer=False)
    hf = build_tiny_qwen2(os.path.join(root, "w1"), seed=1, tokenizer=False)
    return d0, hf


def build(va, model_dir):
    return cpu_vllm.CpuVllm(model_dir, quantization="ascend", choice=cpu_vllm.int8())


def weights_of(hf):
    return [(n, p.detach().clone()) for n, p in hf.named_parameters()]


def synced(va, cold, weights):
    """The rollout's state after one complete list sync of `weights`."""
    with build(va, cold) as v:
        v.model.load_weights(list(weights))
        assert va.end_weight_sync(v.model) == []
        return state(v.model), v.logits(IDS)


def assert_same(got, want):
    assert got.keys() == want.keys()
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"differ: {bad[:6]}"


def refilled(weights):
    """A trainer's stream that yields every tensor as a view of ONE buffer it refills before its
    next yield (no allocation per tensor)."""
    buf = torch.empty(max(t.numel() for _, t in weights), dtype=torch.float32)
    for name, t in weights:
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t)
        yield name, view
    buf.fill_(float("nan"))  # the buffer's next use: whatever still points at it reads NaN


def test_a_generator_that_refills_one_buffer_gives_the_weights_it_yielded(va, models):
    """Before: the loader held float tensors (embedding, norms, biases) by reference until its
    flush, so they were read after the generator had refilled the buffer: `end_weight_sync`
    returned no problem and the logits were off. vLLM's own loader copies each tensor as it
    comes; the sync now equals the list sync of the same weights bit for bit."""
    cold, hf = models
    weights = [(n, t.float()) for n, t in weights_of(hf)]
    want, want_logits = synced(va, cold, weights)
    with build(va, cold) as v:
        v.model.load_weights(refilled(weights))
        assert va.end_weight_sync(v.model) == []
        assert_same(state(v.model), want)
        assert torch.equal(v.logits(IDS), want_logits)


def test_parameters_that_require_grad_are_read_as_their_values(va, models):
    """`named_parameters()` of a trainer module yields nn.Parameter(requires_grad=True). Before:
    a raw torch error naming no tensor. Now their values, as the detached tensors' list sync."""
    cold, hf = models
    want, _ = synced(va, cold, weights_of(hf))
    params = list(hf.named_parameters())
    assert all(p.requires_grad for _, p in params)
    for form in ("list", "stream"):
        with build(va, cold) as v:
            v.model.load_weights(params if form == "list" else iter(params))
            assert va.end_weight_sync(v.model) == []
            assert_same(state(v.model), want)
    assert all(p.requires_grad and p.grad is None for _, p in hf.named_parameters())


def test_float64_tensors_are_read_as_their_values(va, models):
    """fp64 tensors holding fp32 values give what the fp32 sync gives (the same values)."""
    cold, hf = models
    fp32 = [(n, t.float()) for n, t in weights_of(hf)]
    want, _ = synced(va, cold, fp32)
    got, _ = synced(va, cold, [(n, t.double()) for n, t in fp32])
    assert_same(got, want)


NORM = "model.layers.1.post_attention_layernorm.weight"


def _refused_untouched(va, v, sent, named, expected):
    import re

    m = v.model
    before = state(m)
    with pytest.raises(va.WeightSyncError) as info:
        m.load_weights(sent)
    msg = str(info.value)
    assert msg.startswith(named + ":"), msg
    assert re.search(expected, msg), msg
    assert_same(state(m), before)
    assert m._npu_flashrl_loader.inconsistent is None
    assert m._npu_flashrl_loader.pending() == {}
    with pytest.raises(va.WeightSyncError, match="nothing of it was written"):
        va.end_weight_sync(m)


@pytest.mark.parametrize("form", ["list", "stream"])
@pytest.mark.parametrize("named", [NORM, K], ids=["norm", "projection"])
def test_a_sparse_tensor_is_refused_by_name(va, models, named, form):
    """Before: a raw torch error naming no tensor (and, streamed, a model flagged although
    nothing of the sync was written)."""
    cold, hf = models
    weights = weights_of(hf)
    sent = [(named, dict(weights)[named].to_sparse())] + [(n, t) for n, t in weights if n != named]
    with build(va, cold) as v:
        _refused_untouched(va, v, sent if form == "list" else iter(sent), named,
                           r"sparse tensor.*expected a dense")


def _wire(weights):
    from npu_flashrl.quant.wire import int8_wire

    return list(int8_wire(weights, torch.bfloat16))


def test_a_list_call_with_a_nonzero_int8_wire_offset_is_refused_before_anything_is_written(va, models):
    """Before: the pre-check let a non-zero `weight_offset` through; 16 parameters were written
    before it was refused, and the model was flagged."""
    cold, hf = models
    sent = _wire(weights_of(hf))
    offset = K[: -len("weight")] + "weight_offset"
    sent = sent + [(offset, torch.ones(dict(sent)[K].shape[0], 1))]
    with build(va, cold) as v:
        _refused_untouched(va, v, sent, offset, r"non-zero weight_offset")


def test_a_scale_for_a_layer_that_is_not_quantized_is_refused_before_anything_is_written(va, models):
    """A `weight_scale` for a float layer (the lm_head) in a list call: refused by name before any
    tensor of the call is written."""
    cold, hf = models
    sent = _wire(weights_of(hf))
    name = "lm_head.weight_scale"
    sent = sent + [(name, torch.ones(512, 1))]
    with build(va, cold) as v:
        _refused_untouched(va, v, sent, name, r"no such parameter|not quantized")


@pytest.mark.parametrize("form", ["list", "stream"])
def test_an_int8_wire_pair_under_vllms_fused_name_is_refused_by_name(va, models, form):
    """vLLM's fused `qkv_proj` on the INT8 wire. Before: a raw KeyError with a mangled name, and
    the model flagged although nothing was written. Now refused by name, saying the wire sends
    the HF projections (q_proj / k_proj / v_proj), with the model as it was."""
    cold, hf = models
    sent = _wire(weights_of(hf))
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    d = dict(sent)
    parts = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    q = torch.cat([d[p] for p in parts])
    s = torch.cat([d[p[: -len("weight")] + "weight_scale"] for p in parts])
    bad = [(fused[: -len("weight")] + "weight_scale", s), (fused, q)] + \
        [(n, t) for n, t in sent if not n.startswith("model.layers.0.self_attn.") or "o_proj" in n]
    with build(va, cold) as v:
        _refused_untouched(va, v, bad if form == "list" else iter(bad),
                           fused[: -len("weight")] + "weight_scale", r"q_proj.*k_proj.*v_proj")


@pytest.mark.parametrize("form", ["list", "stream"])
def test_a_meta_int8_wire_weight_is_refused_by_name(va, models, form):
    cold, hf = models
    sent = _wire(weights_of(hf))
    bad = [(n, t.to("meta") if n == K else t) for n, t in sent]
    order = sorted(range(len(bad)), key=lambda i: bad[i][0] not in (K, K[: -len("weight")] + "weight_scale"))
    bad = [bad[i] for i in order]
    with build(va, cold) as v:
        _refused_untouched(va, v, bad if form == "list" else iter(bad), K, r"meta tensor")
