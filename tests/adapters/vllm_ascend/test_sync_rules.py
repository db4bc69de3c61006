"""What ends a weight sync, on every stack line: a sync is
complete, refused, or the model refuses to generate, whatever interrupts it; no tensor is
trusted.

1. Completeness is the rule: the end of a sync names every tensor that did not arrive since the
   last complete sync; a partial sync is declared (`end_weight_sync(model, partial=True)`); an
   empty sync is refused.
2. An interrupted stream (KeyboardInterrupt, asyncio.CancelledError: BaseException, not
   Exception) re-raises unchanged and leaves the model refusing to generate.
4. Odd tensors (a bool norm, a meta tensor, a tensor on another device, a name twice in one
   call) are refused by name before anything is written.
5. One copy, a sound pair: a tensor twice in one sync (two buckets) is refused by name; an
   INT8-wire pair is checked as the rollout computes with it, its scale is float32 or the
   rollout's dtype, and its halves pair in either order; "never arrived" names each tensor once.

Real vLLM Qwen2 + vllm-ascend W8A8 layers on the CPU (`cpu_vllm.CpuVllm`). Stand-ins: torch_npu
(the reference kernels of npu_flashrl.kernels.emulation), vLLM attention (plain causal SDPA); for
"another device" a FakeTensor that reports a CUDA device (a CPU test machine has no second device).
"""
import asyncio
import logging
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import state
from npu_flashrl.sim.tiny_models import build_tiny_qwen2

pytestmark = pytest.mark.every_line

IDS = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
LAYER1 = "model.layers.1."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(cold checkpoint dir, trainer weights of a second model, its checkpoint dir)."""
    root = str(tmp_path_factory.mktemp("syncrules"))
    dirs, weights = [], []
    for seed in (0, 1):
        d = os.path.join(root, f"w{seed}")
        hf = build_tiny_qwen2(d, seed=seed, tokenizer=False)
        dirs.append(d)
        weights.append([(n, p.detach().clone()) for n, p in hf.named_parameters()])
    return dirs[0], weights[1], dirs[1]


def build(va, model_dir, **kw):
    """The policy rollout's INT8 model (its engine choice: int8_profile_free)."""
    return cpu_vllm.CpuVllm(model_dir, quantization="ascend", choice=cpu_vllm.int8(), **kw)


def unchanged(before, model):
    after = state(model)
    return after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)


# --------------------------------------------------------------------------- 1. completeness

@pytest.mark.parametrize("pushed", ["all_but_layer_1", "only_norms"])
def test_a_sync_leaving_out_tensors_names_them_and_the_model_refuses_to_generate(va, models, pushed):
    """A sync that omits every tensor of layer 1 (or sends only the norms) ended clean before:
    `end_weight_sync` returned [] and the model generated with weights of two syncs."""
    cold, new, _ = models
    if pushed == "all_but_layer_1":
        sent = [(n, t) for n, t in new if not n.startswith(LAYER1)]
        named = [f"{LAYER1}self_attn.q_proj.weight", f"{LAYER1}input_layernorm.weight"]
    else:
        sent = [(n, t) for n, t in new if "norm" in n]
        named = ["model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"]
    with build(va, cold) as v:
        m = v.model
        m.load_weights(sent)
        with pytest.raises(va.WeightSyncError, match="never arrived since the last complete sync") as info:
            va.end_weight_sync(m)
        for name in named:
            assert name in str(info.value), (name, str(info.value))
        assert "refuses to generate" in str(info.value)
        with pytest.raises(va.WeightSyncError, match="two syncs"):
            v.logits(IDS)
        m.load_weights(new)  # a complete sync lifts it
        assert va.end_weight_sync(m) == []
        v.logits(IDS)


def test_a_declared_partial_sync_ends_clean_and_counts_toward_the_next_complete_one(va, models):
    cold, new, new_dir = models
    with build(va, new_dir) as fresh:
        want = fresh.logits(IDS)
    layer0 = [(n, t) for n, t in new if n.startswith("model.layers.0.")]
    rest = [(n, t) for n, t in new if not n.startswith("model.layers.0.")]
    with build(va, cold) as v:
        m = v.model
        m.load_weights(layer0)
        assert va.end_weight_sync(m, partial=True) == []  # meant: no error, still generates
        assert m._npu_flashrl_loader.inconsistent is None
        v.logits(IDS)
        m.load_weights(rest)  # with layer 0 above: everything arrived since the last complete sync
        assert va.end_weight_sync(m) == []
        assert torch.equal(v.logits(IDS), want)
        # the next sync starts counting afresh: layer 0 alone is incomplete again
        m.load_weights(layer0)
        with pytest.raises(va.WeightSyncError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
            va.end_weight_sync(m)


def test_an_empty_sync_is_refused_and_a_declared_empty_one_warned(va, models, caplog):
    cold, _, _ = models
    with build(va, cold) as v:
        m = v.model
        before = state(m)
        with pytest.raises(va.WeightSyncError, match="nothing arrived"):
            va.end_weight_sync(m)
        m.load_weights([])
        with pytest.raises(va.WeightSyncError, match="nothing arrived"):
            va.end_weight_sync(m)
        assert m._npu_flashrl_loader.inconsistent is None  # nothing was written: still one sync
        v.logits(IDS)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert va.end_weight_sync(m, partial=True) == []
        assert any("nothing arrived" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records), caplog.text
        assert unchanged(before, m)


# --------------------------------------------------------------------------- 2. interruption

@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, asyncio.CancelledError, RuntimeError])
def test_an_interrupted_stream_reraises_unchanged_and_blocks_generation(va, models, exc_type):
    """KeyboardInterrupt / CancelledError (what cancelling verl's asyncio receiver raises) are
    BaseException: they passed the loader's `except Exception`, the model kept generating with a
    mix and `end_weight_sync` returned []. RuntimeError was handled; all three alike now."""
    cold, new, _ = models
    raised = exc_type("stop")

    def stream():
        yield from new[: len(new) // 2]
        raise raised

    with build(va, cold) as v:
        m = v.model
        with pytest.raises(exc_type) as info:
            m.load_weights(stream())
        assert info.value is raised  # re-raised unchanged
        assert m._npu_flashrl_loader.inconsistent is not None
        assert m._npu_flashrl_loader.pending() == {}
        with pytest.raises(va.WeightSyncError, match="two syncs"):
            v.logits(IDS)
        with pytest.raises(va.WeightSyncError, match="weight sync failed.*refuses to generate"):
            va.end_weight_sync(m)
        m.load_weights(new)
        assert va.end_weight_sync(m) == []
        v.logits(IDS)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, asyncio.CancelledError])
def test_an_interruption_before_any_write_keeps_the_model_usable(va, models, exc_type):
    cold, _, _ = models

    def stream():
        raise exc_type()
        yield  # a generator

    with build(va, cold) as v:
        before = state(v.model)
        with pytest.raises(exc_type):
            v.model.load_weights(stream())
        assert v.model._npu_flashrl_loader.inconsistent is None
        with pytest.raises(va.WeightSyncError, match="nothing of it was written"):
            va.end_weight_sync(v.model)
        assert unchanged(before, v.model)
        v.logits(IDS)


# --------------------------------------------------------------------------- 4. odd tensors

def _fake(t):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    return FakeTensor(mode, t.to("meta"), torch.device("cuda", 0))


NORM = "model.layers.1.post_attention_layernorm.weight"
PROJ = "model.layers.0.self_attn.k_proj.weight"

# (id, spoil the good list, the tensor the message names, expected text)
ODD = [
    ("bool_norm", lambda w: _swap(w, NORM, lambda t: t > 0), NORM,
     r"expected a floating-point tensor.*got torch\.bool"),
    ("meta_norm", lambda w: _swap(w, NORM, lambda t: t.to("meta")), NORM, r"meta tensor \(no data"),
    ("meta_projection", lambda w: _swap(w, PROJ, lambda t: t.to("meta")), PROJ, r"meta tensor \(no data"),
    ("other_device_norm", lambda w: _swap(w, NORM, _fake), NORM, r"is on cuda:0; expected cpu"),
    ("other_device_projection", lambda w: _swap(w, PROJ, _fake), PROJ, r"is on cuda:0; expected cpu"),
    ("duplicate_projection", lambda w: w + [(PROJ, dict(w)[PROJ].clone())], PROJ,
     r"appears twice in one load_weights call"),
    ("duplicate_norm", lambda w: w + [(NORM, dict(w)[NORM].clone())], NORM,
     r"appears twice in one load_weights call"),
]


def _swap(weights, name, fn):
    assert any(n == name for n, _ in weights), name
    return [(n, fn(t) if n == name else t) for n, t in weights]


@pytest.mark.parametrize("form", ["list", "stream"])
@pytest.mark.parametrize("case", ODD, ids=[c[0] for c in ODD])
def test_odd_tensors_are_refused_by_name_before_anything_is_written(va, models, case, form):
    """Before: a bool norm was accepted (the norm became 0/1), a meta tensor gave a raw
    NotImplementedError and marked the model inconsistent though nothing was written, a name
    twice in one list was reported as other shards that "never arrived"."""
    import re

    cold, new, _ = models
    _, spoil, named, expected = case
    bad = spoil(list(new))
    if form == "stream":  # the odd item first (a duplicate: its second copy right after the first,
        # still staged / buffered, so nothing was written either)
        odd = [i for i, (n, _) in enumerate(bad) if n == named]
        order = odd + [i for i in range(len(bad)) if i not in odd]
        bad = [bad[i] for i in order]
    with build(va, cold) as v:
        m = v.model
        before = state(m)
        with pytest.raises(va.WeightSyncError) as info:
            m.load_weights(bad if form == "list" else iter(bad))
        msg = str(info.value)
        assert msg.startswith(named + ":"), msg
        assert re.search(expected, msg), msg
        loader = m._npu_flashrl_loader
        assert loader.pending() == {}
        assert unchanged(before, m)
        assert loader.inconsistent is None
        with pytest.raises(va.WeightSyncError, match="nothing of it was written"):
            va.end_weight_sync(m)
        m.load_weights(new)
        assert va.end_weight_sync(m) == []
        assert loader.inconsistent is None


# --------------------------------------------------------------------------- 5. one copy, a sound pair

K = "model.layers.1.self_attn.k_proj.weight"
K_SCALE = "model.layers.1.self_attn.k_proj.weight_scale"


def _wire(weights):
    """The trainer's INT8-wire stream of `weights` (int8 + fp32 scale per projection)."""
    from npu_flashrl.quant.wire import int8_wire

    return list(int8_wire(weights, torch.bfloat16))


def _snapshot(model):
    from helpers import forward_tensors

    return {n: t.detach().clone() for n, t in forward_tensors(model).items()}


@pytest.mark.parametrize("wire,dup", [("float", NORM), ("float", PROJ), ("int8", K), ("int8", K_SCALE)],
                         ids=["float-norm", "float-projection", "int8-weight", "int8-scale"])
def test_a_tensor_sent_twice_in_one_sync_is_refused_by_name(va, models, wire, dup):
    """Two buckets of one sync carry the same tensor. Before: on the float wire the last copy
    won without a word; on the INT8 wire a weight sent again was refused as "int8 without its
    weight_scale before it", a scale sent again left a pair that "never arrived"."""
    cold, new, _ = models
    sent = new if wire == "float" else _wire(new)
    half = len(sent) // 2
    first, second = sent[:half], sent[half:]
    if not any(n == dup for n, _ in first):
        first, second = second, first
    with build(va, cold) as v:
        m = v.model
        m.load_weights(first)
        with pytest.raises(va.WeightSyncError) as info:
            m.load_weights(second + [(dup, dict(sent)[dup].clone())])
        msg = str(info.value)
        assert msg.startswith(f"{dup}: arrived twice in one weight sync"), msg
        with pytest.raises(va.WeightSyncError, match="refuses to generate"):
            va.end_weight_sync(m)  # the first bucket was written: the sync failed part-way
        with pytest.raises(va.WeightSyncError, match="two syncs"):
            v.logits(IDS)
        m.load_weights(first)  # separate syncs may send a tensor again, of course
        m.load_weights(second)
        assert va.end_weight_sync(m) == []
        v.logits(IDS)


@pytest.mark.parametrize("form", ["list", "stream"])
def test_an_int8_wire_scale_the_rollout_would_overflow_with_is_refused(va, models, form):
    """A finite, positive, absurd scale (1e38): before, it was accepted and the next forward
    gave NaN logits. Now the pair is checked as the rollout computes with it (scale times the
    row's int8 values, in the rollout's bf16) and refused by name; nothing is written."""
    cold, new, _ = models
    sent = _wire(new)
    tensors = dict(sent)
    spoiled = tensors[K_SCALE].clone()
    spoiled[3] = 1e38
    bad = [(n, spoiled if n == K_SCALE else t) for n, t in sent]
    if form == "stream":  # the spoiled pair first: nothing was written before it
        bad = [(K_SCALE, spoiled), (K, tensors[K])] + [(n, t) for n, t in bad if n not in (K, K_SCALE)]
    with build(va, cold) as v:
        m = v.model
        before = _snapshot(m)
        with pytest.raises(va.WeightSyncError) as info:
            m.load_weights(bad if form == "list" else iter(bad))
        msg = str(info.value)
        assert msg.startswith(f"{K_SCALE}: row 3's scale 1e+38"), msg
        assert "not finite in bfloat16" in msg, msg
        after = _snapshot(m)
        assert all(torch.equal(after[n], before[n]) for n in before)
        assert m._npu_flashrl_loader.inconsistent is None
        with pytest.raises(va.WeightSyncError, match="nothing of it was written"):
            va.end_weight_sync(m)
        m.load_weights(sent)
        assert va.end_weight_sync(m) == []
        assert torch.isfinite(v.logits(IDS)).all()


def test_an_int8_wire_scale_is_float32_or_the_rollout_dtype(va, models):
    """A float16 scale was accepted and rounded twice on the way to the rollout's bf16; now it is
    refused by name. The rollout's own dtype (bf16) and float32 are accepted."""
    cold, new, _ = models
    sent = _wire(new)
    half = [(n, t.half() if n == K_SCALE else t) for n, t in sent]
    with build(va, cold) as v:
        m = v.model
        with pytest.raises(va.WeightSyncError) as info:
            m.load_weights(half)
        msg = str(info.value)
        assert msg.startswith(f"{K_SCALE}: expected a float32 or bfloat16 (the rollout's dtype) "
                              "scale, got float16"), msg
        with pytest.raises(va.WeightSyncError, match="nothing of it was written"):
            va.end_weight_sync(m)
        m.load_weights([(n, t.bfloat16() if n.endswith("weight_scale") else t) for n, t in sent])
        assert va.end_weight_sync(m) == []


@pytest.mark.parametrize("split", ["one_call", "weights_then_scales"])
def test_an_int8_wire_weight_before_its_scale_pairs_as_the_other_order(va, models, split):
    """Another sender or checkpoint engine may send a weight before its scale (in one call or a
    bucket earlier). Before: refused as "int8 without its weight_scale before it". Now the state
    is bit-identical to the scale-first sync's."""
    cold, new, _ = models
    sent = _wire(new)
    with build(va, cold) as v:
        m = v.model
        m.load_weights(sent)
        assert va.end_weight_sync(m) == []
        want = _snapshot(m)
    swapped = []
    for n, t in sent:  # scale, weight -> weight, scale
        if swapped and swapped[-1][0] == n[: -len("weight")] + "weight_scale":
            swapped.insert(len(swapped) - 1, (n, t))
        else:
            swapped.append((n, t))
    assert [n for n, _ in swapped].index(K) < [n for n, _ in swapped].index(K_SCALE)
    with build(va, cold) as v:
        m = v.model
        if split == "one_call":
            m.load_weights(swapped)
        else:
            m.load_weights([(n, t) for n, t in swapped if not n.endswith("weight_scale")])
            assert K in str(m._npu_flashrl_loader.pending())
            m.load_weights([(n, t) for n, t in swapped if n.endswith("weight_scale")])
        assert va.end_weight_sync(m) == []
        got = _snapshot(m)
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), f"{n} differs"


def test_never_arrived_names_each_tensor_once(va, models):
    """An INT8-wire weight that never comes after its scale did: its layer's staging and its
    wire pair both miss it, and the message listed it twice."""
    cold, new, _ = models
    sent = [(n, t) for n, t in _wire(new) if n != K]
    with build(va, cold) as v:
        m = v.model
        m.load_weights(sent)
        with pytest.raises(va.WeightSyncError) as info:
            va.end_weight_sync(m)
        msg = str(info.value)
        assert msg.count(f"'{K}'") == 1 and "1 shard(s)" in msg, msg
        assert f"INT8 wire: ['{K_SCALE}'] came without the other half" in msg, msg


Q = "model.layers.1.self_attn.q_proj.weight"
QKV = "model.layers.1.self_attn.qkv_proj"


def _skip_if_nz(layer):
    from npu_flashrl import kernels

    if kernels.storage_format(layer.weight.data) != kernels.ACL_FORMAT_ND:
        pytest.skip("this line NZ-casts every W8A8 weight: the INT8 wire is buffered there "
                    "(test_an_nz_cast_weight_takes_the_int8_wire_through_a_buffer)")


@pytest.mark.parametrize("form", ["list", "stream"])
def test_an_nz_cast_weight_takes_the_int8_wire_through_a_buffer(va, models, form):
    """An NZ-cast weight keeps its bytes in fractal blocks, so a narrowed [out, in] view of it is
    not the rows a shard fills: the INT8 wire's pairs wait in a buffer there and the commit makes
    one whole-tensor copy. A refused later bucket leaves the layer untouched; the complete sync
    then equals the ND path's."""
    from npu_flashrl import kernels

    cold, new, _ = models
    sent = _wire(new)
    first = [(n, t) for n, t in sent if n.startswith(Q[: -len("weight")])]
    spoiled = dict(sent)[K_SCALE].clone()
    spoiled[1] = float("nan")
    with build(va, cold, enable_nz=True) as v:
        m = v.model
        layer = m.get_submodule(QKV)
        assert kernels.storage_format(layer.weight.data) != kernels.ACL_FORMAT_ND
        weight = layer.weight.detach().clone()
        m.load_weights(first if form == "list" else iter(first))
        assert torch.equal(layer.weight, weight), "an NZ weight was written through a narrowed view"
        with pytest.raises(va.WeightSyncError, match="contains NaN"):
            m.load_weights([(K_SCALE, spoiled), (K, dict(sent)[K])])
        assert torch.equal(layer.weight, weight)
    with build(va, cold, enable_nz=True) as nz, build(va, cold, enable_nz=False) as nd:
        for v in (nz, nd):
            v.model.load_weights(sent)
            assert va.end_weight_sync(v.model) == []
        for name in ("weight", "weight_scale"):
            assert torch.equal(getattr(nz.model.get_submodule(QKV), name),
                               getattr(nd.model.get_submodule(QKV), name)), name


@pytest.mark.parametrize("form", ["list", "stream"])
def test_a_refused_int8_wire_bucket_after_an_in_place_write_blocks_generation(va, models, form):
    """A linear layer takes the INT8 wire straight into its live weight (no staging copy of the
    fused layer): after q_proj's pair came, layer 1's qkv_proj holds new and old shards. A later
    bucket refused (a NaN k_proj scale) leaves the model refusing to generate, the layer's scales
    still the previous sync's; a complete sync lifts it."""
    cold, new, _ = models
    sent = _wire(new)
    first = [(n, t) for n, t in sent if n.startswith(Q[: -len("weight")])]
    spoiled = dict(sent)[K_SCALE].clone()
    spoiled[1] = float("nan")
    second = [(K_SCALE, spoiled), (K, dict(sent)[K])]
    with build(va, cold, enable_nz=False) as v:  # ND weights, as verl 0.9.1's worker extension sets
        m, loader = v.model, v.model._npu_flashrl_loader
        layer = m.get_submodule(QKV)
        _skip_if_nz(layer)
        weight, scale = layer.weight.detach().clone(), layer.weight_scale.detach().clone()
        m.load_weights(first if form == "list" else iter(first))
        assert not torch.equal(layer.weight, weight), "q_proj's pair was not written in place"
        assert loader.staging_bytes() < weight.numel(), "a buffer of the fused layer was held"
        with pytest.raises(va.WeightSyncError, match="contains NaN"):
            m.load_weights(second if form == "list" else iter(second))
        assert loader.inconsistent is not None
        assert torch.equal(layer.weight_scale, scale)
        with pytest.raises(va.WeightSyncError, match="two syncs"):
            v.logits(IDS)
        with pytest.raises(va.WeightSyncError, match="refuses to generate"):
            va.end_weight_sync(m)
        m.load_weights(sent)
        assert va.end_weight_sync(m) == []
        assert torch.isfinite(v.logits(IDS)).all()


def test_the_int8_wire_receiver_writes_each_weight_byte_about_once(va, models):
    """The INT8 wire's receiver, counted (`sim.costs.CostCounter`, every aten op's bytes): each
    int8 byte goes into the live weight in one pass. Before, it was copied three times (a
    transposing copy on receipt, the loader into a staging buffer, the commit into the layer),
    ~3 bytes written per weight byte; the scales and derived tensors add about a fifth here
    (tiny in=128: one fp32 scale per 128 int8)."""
    from npu_flashrl.sim.costs import CostCounter

    cold, new, _ = models
    sent = [(n, t) for n, t in _wire(new) if n.endswith("_proj.weight") or n.endswith("weight_scale")]
    int8 = sum(t.numel() for n, t in sent if t.dtype == torch.int8)
    with build(va, cold, enable_nz=False) as v:  # ND weights, as verl 0.9.1's worker extension sets
        m = v.model
        _skip_if_nz(m.get_submodule(QKV))
        with CostCounter() as c:
            m.load_weights(sent)
            assert va.end_weight_sync(m, partial=True) == []
    per_byte = c.costs.written_bytes / int8
    # one copy per int8 byte (read once, written once) ...
    assert c.costs.bytes_by_op["copy_"] <= 2.2 * int8, dict(c.costs.bytes_by_op)
    # ... and all else the receiver writes (scales, derived tensors and the checks' per-row
    # results: 0.19 per int8 byte at in=128, less at real widths) stays small; it was 3.37 with
    # the three copies (and 1.37 while the pair check read every int8 weight)
    assert 1.0 <= per_byte < 1.25, (per_byte, dict(c.costs.bytes_by_op))


def test_the_int8_wire_pair_check_reads_the_weight_only_for_a_suspect_scale():
    """The pair check bounds every row by 128 x scale (|int8| <= 128) and reads the int8 rows
    only when that bound is not finite in the rollout's dtype: a scale near bf16's largest
    value / 128 passes when its row's values are small, and fails naming the row when not."""
    from types import SimpleNamespace

    from npu_flashrl.adapters.vllm_ascend.wire import WireReceiver
    from npu_flashrl.quant import WeightSyncError
    from npu_flashrl.sim.costs import CostCounter

    wire = WireReceiver(lambda name: None, SimpleNamespace(compute_dtype=torch.bfloat16))
    q = torch.full((4, 64), 127, dtype=torch.int8)
    with CostCounter() as c:
        wire.check_pair(K, q, torch.full((4,), 0.01))
    assert c.costs.read_bytes < q.numel(), "the int8 weight was read for a sound scale"
    big = torch.full((4,), 0.01)
    big[2] = 3e36  # 128 x 3e36 overflows bf16; 1 x 3e36 does not
    small = q.clone()
    small[2] = 1
    wire.check_pair(K, small, big)
    with pytest.raises(WeightSyncError, match="row 2's scale"):
        wire.check_pair(K, q, big)
