"""Staging of a sync's quantized layers: one interface for dense and fused-MoE layers.

Each incoming projection (or expert) shard is quantized by the caller and handed to its layer's
staging, which fills an int8 buffer in the PROCESSED layout through the layer's own
`weight_loader` (TP narrowing, shard ids and the EP expert map are upstream's): the loader sees
the buffer's checkpoint-layout transpose, so the bytes land where the commit copies them from.
When every shard of the layer arrived in this sync, `commit()` copies the buffer into the live
tensors IN PLACE (their addresses stay), with the scales and every copy post-processing derives
(asked of the line's `layout`). At most one buffer per layer being received is held (MoE,
Qwen3-30B-A3B, TP=1, EP=1: 384 MiB w13 + 192 MiB w2 + 1.75 MiB fp32 scales per layer), never a
second copy of the model.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend import experts as _experts
from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.quant import WeightSyncError

# The template attributes a staging buffer carries, so the layer's weight_loader treats it like
# the parameter it stands for: sharding (output_dim / input_dim / packing) for linear layers,
# quant_method="channel" on scales and is_transposed for fused-MoE ones.
_LOADER_ATTRS = ("output_dim", "input_dim", "packed_dim", "packed_factor",
                 "quant_method", "is_transposed", "load_full_w2")


def stage_param(data: torch.Tensor, template: torch.nn.Parameter) -> torch.nn.Parameter:
    """A buffer the layer's own weight_loader can fill as if it were `template`."""
    p = torch.nn.Parameter(data, requires_grad=False)
    for attr in _LOADER_ATTRS:
        if hasattr(template, attr):
            setattr(p, attr, getattr(template, attr))
    return p


class LayerStaging:
    """One quantized layer of the current sync, staged until every shard this rank holds came.

    `stage(name, q, scale)` loads one quantized shard ([in, out] memory, see the quantizers);
    `complete()` / `missing()` / `received` say what arrived; `buffers()` are the bytes held;
    `commit()` writes the layer in place."""

    def __init__(self, target):
        self.target = target
        self.received: Set[str] = set()

    def stage(self, name: str, q: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
        raise NotImplementedError

    def complete(self) -> bool:
        raise NotImplementedError

    def missing(self) -> List[str]:
        raise NotImplementedError

    def buffers(self) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError


class LinearStaging(LayerStaging):
    """A (fused) linear layer: q/k/v or gate/up shards, or a single projection. `received` holds
    the shard names (q_proj ...)."""

    def __init__(self, target, with_scale: bool):
        super().__init__(target)
        layer = target.layer
        w = layer.weight  # processed: [in_part, out_part]
        # [out, in] view of an [in, out] buffer: upstream's loader narrows it like the
        # unprocessed parameter, while the bytes already sit in the processed layout.
        buf = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        self.weight = stage_param(buf.t(), w)
        self.scale = None
        if with_scale:  # the profile quantizer keeps the checkpoint's scales
            self.scale = stage_param(torch.empty((w.shape[1], 1), dtype=torch.float32,
                                                 device=w.device), layer.weight_scale)

    def stage(self, name, q, scale) -> None:
        t = self.target
        shard = t.shard_of(name)
        sid = t.shard_ids[t.shards.index(shard)]
        args = () if sid is None else (sid,)
        loader = t.layer.weight_loader
        try:
            loader(self.weight, q, *args)
            if scale is not None:
                loader(self.scale, scale.unsqueeze(1), *args)
        except AssertionError as exc:
            raise WeightSyncError(f"{name}: does not fit {t.path} ({exc})") from None
        self.received.add(shard)

    def complete(self) -> bool:
        return len(self.received) == len(self.target.shards)

    def missing(self) -> List[str]:
        return [self.target.hf_name(s) for s in self.target.shards if s not in self.received]

    def buffers(self):
        return (self.weight.data,) + (() if self.scale is None else (self.scale.data,))

    @torch.no_grad()
    def commit(self) -> None:
        t = self.target
        layer = t.layer
        # In place: the processed [in, out] (NZ on NPU) storage keeps its address; the staging
        # buffer is already [in, out], so this is a straight copy.
        layer.weight.data.copy_(self.weight.data.t())
        if self.scale is not None:
            s = self.scale.data.flatten()
            layer.weight_scale.data.copy_(s.to(layer.weight_scale.dtype))
            _layout.current().commit_extras(layer)
            if t.static:
                _layout.current().refresh_static(layer)


class ExpertStaging(LayerStaging):
    """One fused-MoE layer's local experts (vllm-ascend W8A8_DYNAMIC: w13 [E, H, 2I] / w2
    [E, I, H] int8 after post-processing, per-channel scales). `received` holds HF names."""

    def __init__(self, target):
        super().__init__(target)
        layer = target.layer
        gate_up, down = _experts.GATE_UP, _experts.DOWN
        w13, w2 = layer.w13_weight, layer.w2_weight
        # processed [E, H, 2I] / [E, I, H] buffers; the loader sees their checkpoint-layout
        # transposes ([E, 2I, H] / [E, H, I])
        self._w = {gate_up: torch.empty(w13.shape, dtype=torch.int8, device=w13.device),
                   down: torch.empty(w2.shape, dtype=torch.int8, device=w2.device)}
        self._wp = {k: stage_param(v.transpose(1, 2), getattr(layer, f"{k}_weight"))
                    for k, v in self._w.items()}
        e = w13.shape[0]
        self._s = {gate_up: stage_param(torch.empty((e, w13.shape[2], 1), dtype=torch.float32,
                                                    device=w13.device), layer.w13_weight_scale),
                   down: stage_param(torch.empty((e, w2.shape[2], 1), dtype=torch.float32,
                                                 device=w2.device), layer.w2_weight_scale)}

    def stage(self, name, q, scale) -> None:
        t = self.target
        expert_id, shard_id, which = t.names[name]
        loader = _experts.checkpoint_layout_loader(t.layer)
        try:
            ok = loader(self._wp[which], q, f"{t.path}.{which}_weight", shard_id, expert_id,
                        return_success=True)
            if ok is not False:
                ok = loader(self._s[which], scale.unsqueeze(1), f"{t.path}.{which}_weight_scale",
                            shard_id, expert_id, return_success=True)
        except (AssertionError, RuntimeError) as exc:
            raise WeightSyncError(f"{name}: does not fit {t.path} ({exc})") from None
        if ok is False:  # the layer's own expert map says it is not on this rank
            raise WeightSyncError(f"{name}: {t.path}'s weight loader refused expert {expert_id} "
                                  "(not local to this rank), although its expert map had it")
        self.received.add(name)

    def complete(self) -> bool:
        return self.received >= self.target.local

    def missing(self) -> List[str]:
        return sorted(self.target.local - self.received)

    def buffers(self):
        return tuple(self._w.values()) + tuple(p.data for p in self._s.values())

    @torch.no_grad()
    def commit(self) -> None:
        layer = self.target.layer
        for which in (_experts.GATE_UP, _experts.DOWN):
            getattr(layer, f"{which}_weight").data.copy_(self._w[which])
            scale = getattr(layer, f"{which}_weight_scale")
            scale.data.copy_(self._s[which].data.view(scale.shape).to(scale.dtype))
            offset = getattr(layer, f"{which}_weight_offset", None)
            if isinstance(offset, torch.Tensor):
                offset.data.zero_()
        _layout.current().commit_moe_extras(layer)


def new_staging(target, with_scale: bool) -> LayerStaging:
    """The staging for `target`'s kind (`with_scale`: the quantizer writes scales)."""
    if isinstance(target, _experts.ExpertTarget):
        return ExpertStaging(target)
    return LinearStaging(target, with_scale)


class StagingArea:
    """The staged, uncommitted layers of one sync, by layer path."""

    def __init__(self):
        self._layers: Dict[str, LayerStaging] = {}

    def stage(self, target, name: str, q: torch.Tensor, scale: Optional[torch.Tensor]
              ) -> Optional[LayerStaging]:
        """Stage one shard; the layer's staging when it is now complete (popped: the caller
        commits it), else None."""
        st = self._layers.get(target.path)
        if st is None:
            st = new_staging(target, scale is not None)
            self._layers[target.path] = st
        st.stage(name, q, scale)
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
