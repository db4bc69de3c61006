"""vllm-ascend's W8A8_DYNAMIC fused-MoE scheme (`AscendW8A8DynamicFusedMoEMethod`, Qwen3-MoE and
alike): one layer's experts as `w13_weight` [E, H, 2I] and `w2_weight` [E, I, H] int8 (transposed
by its post-processing, NZ on the NPU) with per-channel scales `w13_weight_scale` [E, 2I] /
`w2_weight_scale` [E, H] and the fp32 copy `w13_weight_scale_fp32` (with fused MC2 also int64 bit
patterns of both: the line's `commit_moe_extras`).

The trainer pushes unfused HF names, `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`
(server-mode verl unfuses transformers 5's packed experts before sending); the FusedMoE layer's
own expert mapping says where each goes (`ExpertTarget`). What any fused-MoE layer shares (its
names, its loader without verl's wrapper, the EPLB refusal) is `experts.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Sequence, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend import experts as _experts
from npu_flashrl import lines
from npu_flashrl.adapters.vllm_ascend.schemes.base import (
    MOE, PER_CHANNEL_INT8, LayerStaging, Scheme, UnsupportedScheme, inner_method, stage_param)
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_dynamic import W8A8_DYNAMIC
from npu_flashrl.quant import WeightSyncError

GATE_UP, DOWN = _experts.GATE_UP, _experts.DOWN


@dataclasses.dataclass
class ExpertTarget:
    """One fused-MoE layer and the HF expert names that map into it."""
    path: str                                   # e.g. model.layers.0.mlp.experts
    layer: torch.nn.Module
    names: Dict[str, Tuple[int, str, str]]      # HF name -> (expert id, shard id w1/w2/w3, w13/w2)
    local: FrozenSet[str]                       # the names this rank holds (all, without EP)
    shapes: Dict[str, Tuple[int, int]]          # shard id -> full HF shape
    scheme: "W8A8DynamicMoE"

    def full_shape(self, name: str) -> Tuple[int, int]:
        return self.shapes[self.names[name][1]]

    def weight_device(self) -> torch.device:
        return self.layer.w13_weight.device

    def holds(self, name: str) -> bool:
        """False for an expert another rank holds (expert parallel): checked, then dropped, as
        vLLM's loader drops it."""
        return name in self.local

    def shard_names(self) -> Tuple[str, ...]:
        """The HF names one complete write of this layer needs on this rank."""
        return tuple(sorted(self.local))


class FusedExpertStaging(LayerStaging):
    """What the staging of any fused-MoE layer shares: each HF expert name staged through the
    layer's own `weight_loader` in the checkpoint layout (`load_expert`), the refusals when a
    tensor does not fit or the loader drops an expert its map had, and completeness over the
    layer's local experts. `received` holds HF names."""

    def load_expert(self, name: str, which: str, items) -> None:
        """Stages HF expert `name` (`which`: GATE_UP / DOWN, from the target's names): `items`
        are (staged param, value, suffix after `{which}_weight`), loaded in order; a loader that
        says the expert is not local stops there."""
        t = self.target
        expert_id, shard_id, _ = t.names[name]
        loader = _experts.checkpoint_layout_loader(t.layer)
        prefix = f"{t.path}.{which}_weight"
        try:
            ok = None
            for param, value, suffix in items:
                ok = loader(param, value, prefix + suffix, shard_id, expert_id, return_success=True)
                if ok is False:
                    break
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


class ExpertStaging(FusedExpertStaging):
    """One W8A8 fused-MoE layer's local experts."""

    def __init__(self, target: ExpertTarget):
        super().__init__(target)
        layer = target.layer
        w13, w2 = layer.w13_weight, layer.w2_weight
        # processed [E, H, 2I] / [E, I, H] buffers; the loader sees their checkpoint-layout
        # transposes ([E, 2I, H] / [E, H, I])
        self._w = {GATE_UP: torch.empty(w13.shape, dtype=torch.int8, device=w13.device),
                   DOWN: torch.empty(w2.shape, dtype=torch.int8, device=w2.device)}
        self._wp = {k: stage_param(v.transpose(1, 2), getattr(layer, f"{k}_weight"))
                    for k, v in self._w.items()}
        e = w13.shape[0]
        self._s = {GATE_UP: stage_param(torch.empty((e, w13.shape[2], 1), dtype=torch.float32,
                                                    device=w13.device), layer.w13_weight_scale),
                   DOWN: stage_param(torch.empty((e, w2.shape[2], 1), dtype=torch.float32,
                                                 device=w2.device), layer.w2_weight_scale)}

    def stage(self, name, payload) -> None:
        q, scale = payload.q, payload.scale
        which = self.target.names[name][2]
        self.load_expert(name, which, ((self._wp[which], q, ""),
                                       (self._s[which], scale.unsqueeze(1), "_scale")))

    def buffers(self):
        return tuple(self._w.values()) + tuple(p.data for p in self._s.values())

    @torch.no_grad()
    def commit(self) -> None:
        layer = self.target.layer
        for which in (GATE_UP, DOWN):
            getattr(layer, f"{which}_weight").data.copy_(self._w[which])
            scale = getattr(layer, f"{which}_weight_scale")
            scale.data.copy_(self._s[which].data.view(scale.shape).to(scale.dtype))
            offset = getattr(layer, f"{which}_weight_offset", None)
            if isinstance(offset, torch.Tensor):
                offset.data.zero_()
        self.target.scheme.commit_derived(layer)


@register_scheme(W8A8_DYNAMIC, MOE)
class W8A8DynamicMoE(Scheme):
    wire = PER_CHANNEL_INT8
    needs_scales = True  # the profile quantizer keeps scales: refused at attach for MoE
    patch_name = "ascend_w8a8_dynamic_moe_process_once"
    process_once_why = "fused-MoE post-processing runs once per layer (a second run re-transposes the experts)"

    def targets(self, model: torch.nn.Module, layers: Sequence[Tuple[str, torch.nn.Module]]
                ) -> Dict[str, ExpertTarget]:
        mapping = getattr(model, "get_expert_mapping", None)
        if mapping is None:
            raise UnsupportedScheme(
                f"{type(model).__name__}: has {self.quant_type} fused-MoE layers but no "
                "get_expert_mapping(), so the HF names of its experts cannot be told")
        entries = list(mapping())
        targets: Dict[str, ExpertTarget] = {}
        for path, layer in layers:
            parent, _, leaf = path.rpartition(".")
            names: Dict[str, Tuple[int, str, str]] = {}
            physical = set()
            for param_prefix, weight_prefix, expert_id, shard_id in entries:
                if not param_prefix.startswith(leaf + "."):
                    continue
                which = GATE_UP if param_prefix.endswith("w13_") else DOWN
                names[f"{parent}.{weight_prefix}weight"] = (int(expert_id), shard_id, which)
                physical.add(int(expert_id))
            # the mapping lists physical slots; a name seen twice is a logical expert with copies
            _experts.refuse_unsupported(path, layer, inner_method(layer), len(physical), len(names) // 3)
            local = frozenset(n for n, (e, _, _) in names.items()
                              if layer._map_global_expert_id_to_local_expert_id(e) != -1)
            inter = int(layer.intermediate_size_per_partition) * int(layer.tp_size)
            hidden = int(layer.hidden_size)
            t = ExpertTarget(path, layer, names, local,
                             {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)},
                             self)
            for name in names:
                targets[name] = t
        return targets

    def new_staging(self, target, with_scale: bool, in_place: bool = False) -> ExpertStaging:
        return ExpertStaging(target)  # always buffered: the commit writes all local experts at once

    def commit_derived(self, layer) -> None:
        lines.current().commit_moe_extras(layer)
