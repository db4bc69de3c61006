"""The quantized layers of one rollout model, one map for every layer type: which HF weight name
loads into which layer (a `schemes` target: linear or fused-MoE), and every layer by path.
Built once, when the sync is attached (`schemes.find_targets` per registered layer type)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set

import torch

from npu_flashrl.adapters.vllm_ascend import schemes


# the quant types the INT8 quantizers serve (a quantizer's `serves` says otherwise)
INT8_QUANT_TYPES = (schemes.W8A8_DYNAMIC, schemes.W8A8)


class Targets:
    """HF name -> target of every quantized layer of `model`, whatever its layer type."""

    def __init__(self, model: torch.nn.Module):
        types = list(dict.fromkeys(s.layer_type for s in schemes.registered()))
        self.of_type: Dict[str, Dict[str, object]] = {
            t: schemes.find_targets(model, t) for t in types}
        self.by_name: Dict[str, object] = {}
        for found in self.of_type.values():
            self.by_name.update(found)
        # every quantized layer by path, in the model's order
        self.layers: Dict[str, object] = {t.path: t for t in self.by_name.values()}

    def get(self, name: str):
        """The target `name` loads into, or None."""
        return self.by_name.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    def linear(self) -> Dict[str, object]:
        return self.of_type.get(schemes.LINEAR, {})

    def moe(self) -> Dict[str, object]:
        return self.of_type.get(schemes.MOE, {})

    def modules(self) -> List[torch.nn.Module]:
        return [t.layer for t in self.layers.values()]

    def names_of(self, layers: Iterable[str], floats: Iterable[str],
                 order: Dict[str, int]) -> List[str]:
        """HF names of quantized layers (by path) and float parameters, in the model's order
        (`order`: parameter name -> its index)."""
        keyed = []
        for path in layers:
            t = self.layers[path]
            first = f"{path}.weight" if f"{path}.weight" in order else f"{path}.w13_weight"
            keyed += [(order.get(first, -1), i, n) for i, n in enumerate(t.shard_names())]
        keyed += [(order.get(n, -1), 0, n) for n in floats]
        return [n for _, _, n in sorted(keyed)]

    def bias_owner(self, name: str) -> Optional[object]:
        """The quantized linear layer whose float bias `name` is, or None."""
        if not name.endswith(".bias"):
            return None
        return self.linear().get(name[: -len("bias")] + "weight")

    def required(self, params: Iterable[str]) -> Set[str]:
        """The float parameters a complete sync writes: every one outside the quantized layers,
        and their float biases (checkpoint-only tensors, the scales, are not pushed)."""
        return {n for n in params if n.rsplit(".", 1)[0] not in self.layers or n.endswith(".bias")}


def served_types(quantizer) -> tuple:
    """The vllm-ascend quant types `quantizer` writes: its own (`serves`) and those it serves in
    a mixed checkpoint (`also_serves`: fn w4a8_profile_free's W8A8_DYNAMIC layers)."""
    return tuple(getattr(quantizer, "serves", INT8_QUANT_TYPES)) + tuple(getattr(quantizer, "also_serves", ()))


def check_quantizer(quantizer, targets: Targets, params, model: torch.nn.Module) -> None:
    """Refuse a quantizer that cannot handle every projection of `model` (a profile made for
    another model, or FlashRL's dense-only profile on a MoE model) when the sync is attached,
    before any sync writes anything."""
    from npu_flashrl.quant import WeightSyncError

    experts = targets.moe()
    if experts and getattr(quantizer, "dense_only", False):
        raise no_moe(quantizer, next(iter(experts)),
                     f"{type(model).__name__} is a MoE model ({len(experts)} expert weights)")
    serves = served_types(quantizer)
    for layer in targets.layers.values():
        if layer.scheme.quant_type not in serves:
            raise WeightSyncError(
                f"{layer.path}: a vllm-ascend {layer.scheme.quant_type} layer, and fn "
                f"{quantizer.name!r} quantizes for {'/'.join(serves)} layers only; use "
                f"a checkpoint of {'/'.join(serves)} layers, or the fn of "
                f"{layer.scheme.quant_type} layers")
        layer.scheme.check_target(layer, quantizer)
    own = getattr(quantizer, "serves", INT8_QUANT_TYPES)
    if getattr(quantizer, "also_serves", ()) and targets.layers \
            and not any(t.scheme.quant_type in own for t in targets.layers.values()):
        # served beside its own type only: a checkpoint of those layers alone is another fn's
        first = next(iter(targets.layers.values()))
        raise WeightSyncError(
            f"{first.path}: a vllm-ascend {first.scheme.quant_type} layer, and no layer of the "
            f"model is {'/'.join(own)}: fn {quantizer.name!r} serves "
            f"{'/'.join(quantizer.also_serves)} layers only beside its own (a ModelSlim mixed "
            f"checkpoint); use the fn of {first.scheme.quant_type} layers")
    linear = targets.linear()
    bad = []
    for name in linear:
        try:
            quantizer.check(name, None)
        except WeightSyncError:
            bad.append(name)
    if bad:
        raise WeightSyncError(
            f"{bad[0]}: not in the {quantizer.name} profile ({len(bad)} of "
            f"{len(linear)} projections missing); the profile was made for another "
            "model (re-run `npu-flashrl profile`)")
    # what the quantizer needs beyond the projections (FlashRL's profile: an entry for every
    # layernorm, of the model's shapes), checked as `npu-flashrl verify` checks it
    # (a mixed checkpoint's layers of the types it serves beside its own are not the quantizer's
    # model: fn w4a8_profile_free's group size says nothing of its W8A8_DYNAMIC layers)
    shapes = {name: t.full_shape(name) for name, t in linear.items() if t.scheme.quant_type in own}
    shapes.update((n, tuple(p.shape)) for n, p in params.items()
                  if n.rsplit(".", 1)[0] not in targets.layers)
    quantizer.check_model(shapes, f"the rollout model ({type(model).__name__})")


def no_moe(quantizer, name: str, what: str):
    """The refusal of a quantizer that cannot serve fused-MoE experts (FlashRL's profile): one
    spelling, at the engine build and (should one get past it) at a sync."""
    from npu_flashrl.quant import WeightSyncError
    from npu_flashrl.quant.profile import MOE_FIX, MOE_REASON

    return WeightSyncError(f"{name}: {what} and fn {quantizer.name!r} cannot serve it: {MOE_REASON}; "
                           + MOE_FIX.replace("--fn ", "fn ", 1))
