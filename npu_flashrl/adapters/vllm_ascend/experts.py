"""In-place INT8 reload of vllm-ascend's W8A8_DYNAMIC fused-MoE experts (Qwen3-MoE and alike).

The trainer pushes unfused HF names, `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`
(server-mode verl unfuses transformers 5's packed experts before sending). vllm-ascend's
`AscendW8A8DynamicFusedMoEMethod` holds one layer's experts as `w13_weight` [E, H, 2I] and
`w2_weight` [E, I, H] int8 (transposed by its post-processing, NZ on the NPU) with per-channel
scales `w13_weight_scale` [E, 2I] / `w2_weight_scale` [E, H] and the fp32 copy
`w13_weight_scale_fp32`.

This module finds those layers and the HF names that map into them (`ExpertTarget`); a sync
stages and commits them like every other quantized layer (`staging.ExpertStaging`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Optional, Tuple

import torch

from npu_flashrl import compat
from npu_flashrl.adapters.vllm_ascend.description import UnsupportedScheme
from npu_flashrl.adapters.vllm_ascend.targets import inner_method

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

    def weight_device(self) -> torch.device:
        return self.layer.w13_weight.device

    def holds(self, name: str) -> bool:
        """False for an expert another rank holds (expert parallel): checked, then dropped, as
        vLLM's loader drops it."""
        return name in self.local


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
    layers = [(p, m) for p, m in model.named_modules() if isinstance(inner_method(m), moe_cls)]
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
        refuse_unsupported(path, layer, inner_method(layer), len(physical), len(names) // 3)
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

    Server-mode verl on an NPU (`verl.utils.vllm.npu_vllm_patch`, applied when `verl.utils.vllm` is
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
