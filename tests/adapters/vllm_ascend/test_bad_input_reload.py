"""Bad input to a weight reload : each is a WeightSyncError naming the
parameter and the expected shape or form, and the model is left exactly as it was.

Real vLLM + vllm-ascend code on CPU; stand-ins as in test_vllm_ascend_reload (emulated torch_npu,
plain SDPA attention). Each case is run as a list call (checked whole before any write) and as a
stream whose first item is the bad one (checked item by item; nothing was written before it).
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.tiny_models import build_tiny_qwen2

pytestmark = pytest.mark.every_line

H, V = 128, 512  # tiny Qwen2: hidden size, vocab


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("badreload"))
    out = {}
    for tied in (False, True):
        d = os.path.join(root, f"tied{int(tied)}")
        hf = build_tiny_qwen2(d, seed=1, config_overrides={"tie_word_embeddings": tied})
        out[tied] = (d, [(n, p.detach().clone()) for n, p in hf.named_parameters()])
    return out


def _grow(t):
    return torch.cat([t, t[:1]])


# (id, tied model?, how to spoil the good weights, parameter the message must name, expected text)
CASES = [
    ("norm_shape", False, lambda w: _swap(w, "model.layers.1.input_layernorm.weight", _grow),
     "model.layers.1.input_layernorm.weight", rf"expected shape \({H},\), got \({H + 1},\)"),
    ("final_norm_shape", False, lambda w: _swap(w, "model.norm.weight", lambda t: t[:-1]),
     "model.norm.weight", rf"expected shape \({H},\)"),
    ("embedding_shape", False, lambda w: _swap(w, "model.embed_tokens.weight", _grow),
     "model.embed_tokens.weight", rf"expected shape \({V}, {H}\), got \({V + 1}, {H}\)"),
    ("lm_head_shape", False, lambda w: _swap(w, "lm_head.weight", lambda t: t[:, :-1]),
     "lm_head.weight", rf"expected shape \({V}, {H}\)"),
    ("bias_shape", False, lambda w: _swap(w, "model.layers.0.self_attn.q_proj.bias", _grow),
     "model.layers.0.self_attn.q_proj.bias", rf"expected shape \({H},\), got \({H + 1},\)"),
    ("tied_lm_head_shape", True, lambda w: w + [("lm_head.weight", torch.zeros(V + 3, H, dtype=torch.bfloat16))],
     "lm_head.weight", rf"expected shape \({V}, {H}\), got \({V + 3}, {H}\)"),
    ("three_tuple", False, lambda w: w + [("model.norm.weight", w[0][1], "extra")],
     "model.norm.weight", r"expected a \(name, tensor\) pair, got a 3-item tuple"),
    ("bare_string", False, lambda w: w + ["model.layers.0.mlp.up_proj.weight"],
     "model.layers.0.mlp.up_proj.weight", r"expected a \(name, tensor\) pair, got a bare string"),
    ("not_a_tensor", False, lambda w: _swap(w, "model.layers.0.post_attention_layernorm.weight", lambda t: t.tolist()),
     "model.layers.0.post_attention_layernorm.weight", r"expected a torch\.Tensor, got list"),
    ("projection_not_a_tensor", False, lambda w: _swap(w, "model.layers.0.mlp.down_proj.weight", lambda t: t.float().numpy()),
     "model.layers.0.mlp.down_proj.weight", r"expected a torch\.Tensor, got ndarray"),
]


def _swap(weights, name, fn):
    assert any(n == name for n, *_ in weights), name
    return [(n, fn(t)) if n == name else item for item in weights for n, t in [item[:2]]]


def _bad_first(bad, good):
    """The spoiled items first, then the rest: a stream that fails before anything is written."""
    good_ids = {id(item) for item in good}
    spoiled = [item for item in bad if id(item) not in good_ids]
    return spoiled + [item for item in bad if id(item) in good_ids]


@pytest.mark.parametrize("form", ["list", "stream"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_reload_input_is_named_and_changes_nothing(va, models, case, form):
    import re

    _, tied, spoil, param, expected = case
    model_dir, good = models[tied]
    bad = spoil(list(good))
    with cpu_vllm.CpuVllm(model_dir, quantization="ascend", choice=cpu_vllm.int8()) as v:
        before = {n: p.detach().clone() for n, p in v.model.named_parameters()}
        call = bad if form == "list" else iter(_bad_first(bad, good))
        with pytest.raises(va.WeightSyncError) as info:
            v.model.load_weights(call)
        msg = str(info.value)
        assert msg.startswith(param + ":"), msg
        assert re.search(expected, msg), msg
        after = {n: p.detach().clone() for n, p in v.model.named_parameters()}
        assert after.keys() == before.keys()
        for n in before:
            assert torch.equal(after[n], before[n]), f"{n} changed"
        assert v.model._npu_flashrl_loader.pending() == {}
        assert v.model._npu_flashrl_loader.inconsistent is None
        # the good weights still load afterwards
        v.model.load_weights(good)
        with pytest.raises(va.WeightSyncError):  # ...but the failed sync is still reported once
            va.end_weight_sync(v.model)
        v.model.load_weights(good)
        assert va.end_weight_sync(v.model) == []
