"""Weight-sync helpers for tests and benchmarks: deliver a sync the way verl 0.9 does (buckets as
views of one reused buffer), and compare model states.

verl 0.9.1's `update_weights_from_ipc` calls `model.load_weights` once per bucket with VIEWS of a
reused buffer (the shards of one fused layer, or the experts of one MoE layer, may sit in
different buckets; the next bucket overwrites the buffer), then vLLM's
`process_weights_after_loading` once per sync. `BucketBuffer` + `split_buckets` + `post_sync` do
exactly that on a CPU model; the buffer is the only stand-in for verl's sender (no ZMQ / IPC).
"""
from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Weights = Sequence[Tuple[str, torch.Tensor]]


class BucketBuffer:
    """verl's BucketedWeightSender in miniature: each bucket is packed into ONE reused byte
    buffer and delivered as views of it; the buffer is overwritten (with NaN bytes) as soon as
    `load_weights` returns, before the next bucket."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.uint8)

    def deliver(self, model, bucket: Weights) -> None:
        views, off = [], 0
        for name, t in bucket:
            n = t.numel() * t.element_size()
            v = self.buf[off:off + n].view(t.dtype).view(t.shape)
            v.copy_(t)
            views.append((name, v))
            off += (n + 63) // 64 * 64
        assert off <= self.buf.numel(), "bucket larger than the buffer"
        model.load_weights(views)
        self.buf.fill_(0xFF)  # the next bucket reuses the memory: 0xFFFF is NaN in bf16


def split_buckets(weights: Weights, nbytes: int) -> List[List[Tuple[str, torch.Tensor]]]:
    """Consecutive buckets of at most `nbytes` (64-byte aligned tensors; one larger tensor alone)."""
    buckets, cur, size = [], [], 0
    for name, t in weights:
        n = (t.numel() * t.element_size() + 63) // 64 * 64
        if cur and size + n > nbytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += n
    return buckets + ([cur] if cur else [])


def random_buckets(weights: Weights, seed: int, max_bytes: int) -> List[List[Tuple[str, torch.Tensor]]]:
    """The weights shuffled, then cut into buckets of random sizes up to `max_bytes`."""
    rng = random.Random(seed)
    items = list(weights)
    rng.shuffle(items)
    return cut_randomly(items, rng, max_bytes)


def cut_randomly(items, rng: random.Random, max_bytes: int) -> List[List[Tuple[str, torch.Tensor]]]:
    """`items` in their order, cut into buckets of random sizes up to `max_bytes` drawn from `rng`."""
    out, i = [], 0
    while i < len(items):
        chunk = split_buckets(items[i:], rng.randint(1, max_bytes))[0]
        out.append(chunk)
        i += len(chunk)
    return out


def bucket_bytes(buckets) -> int:
    return max(sum((t.numel() * t.element_size() + 63) // 64 * 64 for _, t in b) for b in buckets)


def post_sync(v) -> None:
    """What verl 0.9 runs after the last bucket of every sync (`v`: a CpuVllm)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(v.model, v.vllm_config.model_config, torch.device("cpu"))


def state(model) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ptrs(model) -> Dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def assert_same_state(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor],
                      only: Optional[str] = None) -> None:
    assert a.keys() == b.keys()
    for n in a:
        if only is None or only in n:
            assert torch.equal(a[n], b[n]), f"{n} differs"
