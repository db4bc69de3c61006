"""The staged, uncommitted layers of one sync (`StagingArea`), whatever their scheme.

Each incoming projection (or expert) shard is quantized by the caller (its scheme's payload,
`Scheme.quantize`) and handed to its layer's
staging (`scheme.new_staging`, `schemes/`), which fills an int8 buffer in the PROCESSED layout
through the layer's own `weight_loader` (TP narrowing, shard ids and the EP expert map are
upstream's): the loader sees the buffer's checkpoint-layout transpose, so the bytes land where
the commit copies them from. When every shard of the layer arrived in this sync, `commit()`
copies the buffer into the live tensors IN PLACE (their addresses stay), with the scales and
every copy post-processing derives (the scheme's `commit_derived`). At most one buffer per layer
being received is held (MoE, Qwen3-30B-A3B, TP=1, EP=1: 384 MiB w13 + 192 MiB w2 + 1.75 MiB fp32
scales per layer), never a second copy of the model. The INT8 wire's pairs (final values, checked
before they are staged) go into a linear layer's live weight at once instead (`in_place`,
`LinearStaging`): no buffer, and the sync counts the layer as written from then on.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

from npu_flashrl.adapters.vllm_ascend.schemes import (  # noqa: F401  (the stagings, by scheme)
    ExpertStaging, LayerStaging, LinearStaging)
from npu_flashrl.adapters.vllm_ascend.schemes.base import stage_param  # noqa: F401


def new_staging(target, with_scale: bool, in_place: bool = False) -> LayerStaging:
    """The staging for `target`'s scheme (`with_scale`: the quantizer writes scales; `in_place`:
    final values the scheme may write straight into the live layer)."""
    return target.scheme.new_staging(target, with_scale, in_place)


class StagingArea:
    """The staged, uncommitted layers of one sync, by layer path."""

    def __init__(self):
        self._layers: Dict[str, LayerStaging] = {}

    def open(self, target, with_scale: bool, in_place: bool = False) -> LayerStaging:
        """`target`'s staging of this sync, begun now if none is (its first shard decides
        whether it writes in place)."""
        st = self._layers.get(target.path)
        if st is None:
            st = self._layers[target.path] = new_staging(target, with_scale, in_place)
        return st

    def stage(self, target, name: str, payload) -> Optional[LayerStaging]:
        """Stage one shard (its scheme's payload); the layer's staging when it is now complete
        (popped: the caller commits it), else None."""
        st = self.open(target, payload.with_scale)
        st.stage(name, payload)
        if st.complete():
            return self._layers.pop(target.path)
        return None

    def missing(self) -> List[str]:
        return [n for st in self._layers.values() for n in st.missing()]

    def drop(self) -> None:
        self._layers.clear()

    def received(self) -> Dict[str, List[str]]:
        return {p: sorted(st.received) for p, st in self._layers.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for st in self._layers.values() for t in st.buffers())

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterable[LayerStaging]:
        return iter(self._layers.values())
