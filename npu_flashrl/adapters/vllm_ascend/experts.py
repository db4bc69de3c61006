"""In-place INT8 reload of vllm-ascend's W8A8_DYNAMIC fused-MoE experts (Qwen3-MoE and alike).

The trainer pushes unfused HF names, `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`
(verl 0.9 unfuses transformers 5's packed experts before sending). vllm-ascend's
`AscendW8A8DynamicFusedMoEMethod` holds one layer's experts as `w13_weight` [E, H, 2I] and
`w2_weight` [E, I, H] int8 (transposed by its post-processing, NZ on the NPU) with per-channel
scales `w13_weight_scale` [E, 2I] / `w2_weight_scale` [E, H] and the fp32 copy
`w13_weight_scale_fp32`.

Each incoming expert shard is quantized and staged through the FusedMoE layer's own
`weight_loader` (expert id, shard id, TP narrowing and the EP expert map are upstream's) into an
int8 buffer in the processed layout; when every shard of the layer's local experts arrived in
this sync, the buffer is copied into the live tensors IN PLACE, with the scales and every copy
post-processing derives (asked of the line's `layout`). At most one layer's experts are staged
per layer being received (Qwen3-30B-A3B, TP=1, EP=1: 384 MiB w13 + 192 MiB w2 + 1.75 MiB fp32
scales), never a second copy of the model.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Optional, Set, Tuple

import torch

from npu_flashrl import compat
from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend.description import UnsupportedScheme
from npu_flashrl.quant import WeightSyncError

GATE_UP = "w13"
DOWN = "w2"


@dataclasses.dataclass
class ExpertTarget:
    """One fused-MoE layer and the HF expert names that map into it."""
    path: str                                   # e.g. model.layers.0.mlp.experts
    layer: torch.nn.Module
    names: Dict[str, Tuple[int, str, str]]      # HF name -> (expert id, shard id w1/w2/w3, w13/w2)
    local: FrozenSet[str]                       # the names this rank holds (all, without EP)
    shapes: Dict[str, Tuple[int, int]]          # shard id -> full HF shape

    def full_shape(self, name: str) -> Tuple[int, int]:
        return self.shapes[self.names[name][1]]


def _inner(module):
    return getattr(getattr(module, "quant_method", None), "quant_method", None)


def refuse_unsupported(path: str, layer, scheme, physical: int, logical: int) -> None:
    """Settings under which vllm-ascend keeps the experts somewhere an in-place reload would not
    reach (or would scramble): refused by name at engine build."""
    if getattr(scheme, "dynamic_eplb", False):
        raise UnsupportedScheme(
            f"{path}: dynamic EPLB is on (vllm-ascend additional_config eplb_config.dynamic_eplb / "
            "dynamic_eplb): experts move between ranks and slots at run time and their weights "
            "live in per-expert copies, so an in-place INT8 reload would write experts into the "
            "wrong slots. Turn dynamic EPLB off for INT8 rollouts")
    if physical > logical:
        raise UnsupportedScheme(
            f"{path}: {physical - logical} redundant expert slot(s) (num_redundant_experts / "
            "EPLB): a logical expert has several physical copies, which npu_flashrl's reload does "
            "not track; set num_redundant_experts=0 for INT8 rollouts")


def find_expert_targets(model: torch.nn.Module) -> Dict[str, ExpertTarget]:
    """Map every HF expert weight name to its W8A8_DYNAMIC fused-MoE layer (empty for a dense
    model)."""
    moe_cls = compat.moe_method_class()
    layers = [(p, m) for p, m in model.named_modules() if isinstance(_inner(m), moe_cls)]
    if not layers:
        return {}
    mapping = getattr(model, "get_expert_mapping", None)
    if mapping is None:
        raise UnsupportedScheme(
            f"{type(model).__name__}: has W8A8_DYNAMIC fused-MoE layers but no "
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
        refuse_unsupported(path, layer, _inner(layer), len(physical), len(names) // 3)
        local = frozenset(n for n, (e, _, _) in names.items()
                          if layer._map_global_expert_id_to_local_expert_id(e) != -1)
        inter = int(layer.intermediate_size_per_partition) * int(layer.tp_size)
        hidden = int(layer.hidden_size)
        t = ExpertTarget(path, layer, names, local,
                         {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)})
        for name in names:
            targets[name] = t
    return targets


def expert_name_mapping(model) -> Tuple[Tuple[str, str], ...]:
    """(param prefix, HF weight prefix) pairs of the model's own expert mapping (empty for a
    model without one); read once per loader."""
    mapping = getattr(model, "get_expert_mapping", None)
    if mapping is None:
        return ()
    return tuple((param_prefix, weight_prefix) for param_prefix, weight_prefix, _, _ in mapping())


def resolve_float_expert(mapping, name: str) -> Optional[str]:
    """The parameter an unquantized (FLOAT) expert weight loads into, through `mapping`
    (`expert_name_mapping`: '...experts.3.gate_proj.weight' -> '...experts.w13_weight'), or None."""
    if ".experts." not in name:
        return None
    for param_prefix, weight_prefix in mapping:
        if weight_prefix in name:
            return name.replace(weight_prefix, param_prefix)
    return None


def checkpoint_layout_loader(layer):
    """The FusedMoE layer's own `weight_loader`, without verl's NPU transpose wrapper.

    verl >= 0.8 on an NPU (`verl.utils.vllm.npu_vllm_patch`, applied when `verl.utils.vllm` is
    imported) wraps `FusedMoE.weight_loader` to transpose a parameter whose dim 1 (w1/w3) or dim 2
    (w2) equals hidden_size, for bf16 reloads into vllm-ascend's post-processed [E, H, 2I] experts.
    npu_flashrl stages in the checkpoint layout [E, 2I, H] / [E, H, I], which that test misreads
    whenever 2 * moe_intermediate_size (or moe_intermediate_size) equals hidden_size: the gate / up
    rows would be written transposed. The wrapper marks itself (`_verl_npu_weight_loader_patched`,
    `__wrapped__`); only it is skipped, vLLM's loader and any other wrapper stay."""
    fn = getattr(type(layer), "weight_loader", None)
    while fn is not None and getattr(fn, "_verl_npu_weight_loader_patched", False) \
            and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if fn is None:
        return layer.weight_loader
    return fn.__get__(layer, type(layer))


def _stage_param(data: torch.Tensor, template: torch.nn.Parameter) -> torch.nn.Parameter:
    # carries the template's loader attributes (quant_method="channel" on scales, is_transposed)
    p = torch.nn.Parameter(data, requires_grad=False)
    for attr in ("quant_method", "is_transposed", "load_full_w2"):
        if hasattr(template, attr):
            setattr(p, attr, getattr(template, attr))
    return p


class ExpertStaging:
    """One layer's experts of this sync, in the processed layout, until all local shards came."""

    def __init__(self, target: ExpertTarget):
        layer = target.layer
        self.target = target
        self.received: Set[str] = set()
        w13, w2 = layer.w13_weight, layer.w2_weight
        # processed [E, H, 2I] / [E, I, H] buffers; the loader sees their checkpoint-layout
        # transposes ([E, 2I, H] / [E, H, I]), so the bytes land where the commit copies them from
        self._w = {GATE_UP: torch.empty(w13.shape, dtype=torch.int8, device=w13.device),
                   DOWN: torch.empty(w2.shape, dtype=torch.int8, device=w2.device)}
        self._wp = {k: _stage_param(v.transpose(1, 2), getattr(layer, f"{k}_weight"))
                    for k, v in self._w.items()}
        e = w13.shape[0]
        self._s = {GATE_UP: _stage_param(torch.empty((e, w13.shape[2], 1), dtype=torch.float32,
                                                     device=w13.device), layer.w13_weight_scale),
                   DOWN: _stage_param(torch.empty((e, w2.shape[2], 1), dtype=torch.float32,
                                                  device=w2.device), layer.w2_weight_scale)}

    def stage(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        t = self.target
        expert_id, shard_id, which = t.names[name]
        loader = checkpoint_layout_loader(t.layer)
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

    def missing(self):
        return sorted(self.target.local - self.received)

    def buffers(self):
        return tuple(self._w.values()) + tuple(p.data for p in self._s.values())

    @torch.no_grad()
    def commit(self) -> None:
        """Write the staged layer into the live tensors in place (their addresses stay)."""
        layer = self.target.layer
        for which in (GATE_UP, DOWN):
            getattr(layer, f"{which}_weight").data.copy_(self._w[which])
            scale = getattr(layer, f"{which}_weight_scale")
            scale.data.copy_(self._s[which].data.view(scale.shape).to(scale.dtype))
            offset = getattr(layer, f"{which}_weight_offset", None)
            if isinstance(offset, torch.Tensor):
                offset.data.zero_()
        _layout.current().commit_moe_extras(layer)
