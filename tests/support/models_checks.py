"""The per-architecture INT8 rollout protocol of the tests/test_models_*.py modules (imported as
`models_checks`: tests/ is on sys.path, as `helpers` is).

`three_syncs` runs, on one rollout model cold-loaded in INT8 from checkpoint 0: three weight syncs
(1: fp32 masters, 2: bf16, 3: bf16 after a first attempt with a NaN in one tensor that is refused
by name), each delivered as verl 0.9 delivers it (random order, random buckets as views of one
reused buffer, `process_weights_after_loading` once per sync) and each checked against a FRESH
INT8 load of the same weights: every tensor a forward reads (int8 values, scales, and every
tensor vllm-ascend or vLLM derive as a plain attribute when the model is processed) bit-identical,
parameter storage unchanged, logits equal.
"""
from __future__ import annotations

import random
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from npu_flashrl.sim.sync import BucketBuffer, bucket_bytes, post_sync, ptrs, random_buckets

from helpers import build


def derived_tensors(model) -> Dict[str, torch.Tensor]:
    """Everything a forward reads: parameters, buffers, and every tensor a module holds as a plain
    attribute (vllm-ascend's `weight_scale_fp32`, MLA's absorbed per-head matrices, ...)."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    out.update((f"buffer:{n}", b) for n, b in model.named_buffers())
    for name, mod in model.named_modules():
        for attr, t in vars(mod).items():
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                out[f"{name}.{attr}"] = t
    return out


_FRESH: Dict[tuple, tuple] = {}


def fresh_load(va, model_dir: str, ids: torch.Tensor, forward: Callable, **build_kw):
    """(snapshot, forward output) of a fresh INT8 load of `model_dir`, built once per process
    for the same directory, inputs, forward and build options (the sync and wire checks of a
    module compare against the same fresh loads)."""
    key = (model_dir, tuple(ids.reshape(-1).tolist()), forward, tuple(sorted(build_kw.items())))
    if key not in _FRESH:
        with build(va, model_dir, **build_kw) as f:
            _FRESH[key] = (snapshot(f.model), forward(f, ids))
    return _FRESH[key]


def snapshot(model) -> Dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in derived_tensors(model).items()}


def assert_bit_identical(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: tensors differ: {sorted(got.keys() ^ want.keys())[:8]}"
    for n in want:
        a, b = got[n], want[n]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {n} {a.dtype}{tuple(a.shape)} " \
                                                         f"vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{what}: {n} differs"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaN == NaN, -0.0 != 0.0: bit-identical means the same bytes)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def fp32_masters(weights, seed: int, exact: Sequence[str] = ()) -> List[Tuple[str, torch.Tensor]]:
    """fp32 master weights whose bf16 cast is `weights`: sub-bf16 noise the cast removes (a
    rollout in bf16 quantizes what it holds, the bf16 cast; see test_vllm_ascend_reload). Names
    ending in `exact` (tensors the rollout keeps in fp32, e.g. DeepSeek's router correction
    bias) are sent as they are: a fresh load holds them unrounded too."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, t in weights:
        if n.endswith(tuple(exact)) and exact:
            out.append((n, t.float()))
            continue
        f = t.float()
        noisy = f + f.abs() * 2e-7 * torch.rand(f.shape, generator=g)
        assert torch.equal(noisy.to(torch.bfloat16), t.to(torch.bfloat16)), n
        out.append((n, noisy))
    return out


def _logits(v, ids):
    return v.logits(ids)


def split_groups(buckets, groups: Dict[str, Sequence[str]]) -> List[str]:
    """The fused layers (prefix -> checkpoint names of its shards) whose shards sit in more than
    one bucket."""
    where = {n: b for b, bucket in enumerate(buckets) for n, _ in bucket}
    return [g for g, names in groups.items() if len({where[n] for n in names if n in where}) > 1]


def three_syncs(va, dirs: Sequence[str], send: Callable[[int], List[Tuple[str, torch.Tensor]]],
                ids: torch.Tensor, fused: Dict[str, Sequence[str]], nan_name: str,
                check: Optional[Callable] = None, max_bytes: int = 96 << 10,
                logits: Optional[Callable] = None, exact: Sequence[str] = (), **build_kw) -> dict:
    """Cold INT8 load of dirs[0], then syncs of send(1), send(2), send(3) (see the module doc).
    `fused`: fused rollout layers -> their checkpoint shard names (at least one must be split over
    buckets in every sync); `check(model, k)`: architecture checks after the cold load (k=0) and
    each sync; `logits(v, ids)`: the forward (default `CpuVllm.logits`). Returns what it measured."""
    forward = logits or _logits
    fresh = {k: fresh_load(va, dirs[k], ids, forward, **build_kw) for k in (1, 2, 3)}
    splits = []
    with build(va, dirs[0], **build_kw) as v:
        m = v.model
        if check:
            check(m, 0)
        before = ptrs(m)
        derived_before = {n: t.data_ptr() for n, t in derived_tensors(m).items()}
        rng = random.Random(7)
        for k in (1, 2, 3):
            weights = send(k)
            if k == 1:
                weights = fp32_masters(weights, seed=k, exact=exact)
            buckets = random_buckets(weights, seed=rng.randint(0, 1 << 30), max_bytes=max_bytes)
            split = split_groups(buckets, fused)
            assert split, "no fused layer was split over buckets: shrink max_bytes"
            splits.append(len(split))
            buffer = BucketBuffer(bucket_bytes(buckets))
            if k == 3:
                # a first attempt with a NaN in one tensor: refused by name, no generation on the
                # weights of two syncs, then the complete sync again
                bad = [[(n, t.clone().fill_(float("nan")) if n == nan_name else t) for n, t in b]
                       for b in buckets]
                with pytest.raises(va.WeightSyncError, match=nan_name.replace(".", r"\.")):
                    for bucket in bad:
                        buffer.deliver(m, bucket)
                with pytest.raises(va.WeightSyncError):
                    va.end_weight_sync(m)
                if not any(n == nan_name for n, _ in buckets[0]):  # weights were written
                    with pytest.raises(va.WeightSyncError, match="two syncs|complete sync"):
                        forward(v, ids)
            for bucket in buckets:
                buffer.deliver(m, bucket)
            assert va.end_weight_sync(m) == []
            post_sync(v)
            want, want_logits = fresh[k]
            assert_bit_identical(snapshot(m), want, f"sync {k}")
            assert ptrs(m) == before, f"sync {k}: a parameter was reallocated"
            # vLLM's Attention re-creates its fp8 KV-cache ranges (q/k/v_range: scalar constants,
            # compared by value above) in its own process_weights_after_loading, bf16 model or not
            moved = [n for n, t in derived_tensors(m).items()
                     if derived_before.get(n) != t.data_ptr() and not n.endswith("_range")]
            assert not moved, f"sync {k}: derived tensors reallocated: {moved[:6]}"
            if check:
                check(m, k)
            got = forward(v, ids)
            assert torch.equal(got, want_logits), f"sync {k}: logits differ from a fresh load's"
    return {"split_fused_layers": splits}


def wire_syncs(va, dirs: Sequence[str], send: Callable[[int], List[Tuple[str, torch.Tensor]]],
               ids: torch.Tensor, logits: Optional[Callable] = None, max_bytes: int = 96 << 10,
               **build_kw) -> dict:
    """The INT8 wire's receiving end: syncs of `npu_flashrl.quant.wire.int8_wire(send(k))` (what
    the trainer-side patch sends: int8 + fp32 scale for the projections its name rule knows,
    everything else as it is) in random buckets, each equal to a fresh INT8 load of the same
    weights with the receiver quantizing nothing it got pre-quantized. Returns how many
    projections travelled as int8 and how many the rollout quantized itself (names the wire's
    rule does not know travel float and are quantized on arrival)."""
    from npu_flashrl.quant.wire import int8_wire, is_projection

    forward = logits or _logits
    fresh = {k: fresh_load(va, dirs[k], ids, forward, **build_kw) for k in (1, 2)}
    counts = {}
    with build(va, dirs[0], **build_kw) as v:
        m = v.model
        loader = m._npu_flashrl_loader
        before = ptrs(m)
        seen = []
        original = loader.quantizer.quantize
        loader.quantizer.quantize = lambda *a, **kw: seen.append(a[0]) or original(*a, **kw)
        for k in (1, 2):
            seen.clear()
            weights = send(k)
            wire = list(int8_wire(weights, torch.bfloat16))
            buckets = _ordered_random_buckets(wire, seed=k, max_bytes=max_bytes)
            buffer = BucketBuffer(bucket_bytes(buckets))
            for bucket in buckets:
                buffer.deliver(m, bucket)
            assert va.end_weight_sync(m) == []
            post_sync(v)
            want, want_logits = fresh[k]
            assert_bit_identical(snapshot(m), want, f"wire sync {k}")
            assert ptrs(m) == before
            assert torch.equal(forward(v, ids), want_logits)
            counts = {"int8": sum(1 for n, t in wire if t.dtype == torch.int8),
                      "quantized_on_arrival": len(seen)}
            assert counts["int8"] == sum(1 for n, _ in weights if is_projection(n))
    return counts


def _ordered_random_buckets(wire, seed: int, max_bytes: int):
    """The wire's items in random order with each weight_scale kept right before its int8 weight
    (the wire's one ordering rule), cut into buckets of random sizes (a pair may be split)."""
    from npu_flashrl.sim.sync import cut_randomly

    units, i = [], 0
    while i < len(wire):
        n = 2 if wire[i][0].endswith(".weight_scale") else 1
        units.append(wire[i:i + n])
        i += n
    rng = random.Random(seed)
    rng.shuffle(units)
    return cut_randomly([item for unit in units for item in unit], rng, max_bytes)
