"""What every fused-MoE layer shares, whatever its quantization scheme: its HF expert names
(`expert_name_mapping`, `resolve_float_expert` for unquantized experts), its own weight loader
without verl's NPU transpose wrapper (`checkpoint_layout_loader`), and the settings under which
vllm-ascend keeps experts where an in-place reload would not reach (`refuse_unsupported`).

The trainer pushes unfused HF names, `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`.
The quantized fused-MoE layers a sync writes into are found and staged by their scheme
(`schemes/w8a8_dynamic_moe.py`: `ExpertTarget`, `ExpertStaging`).
"""
from __future__ import annotations

from typing import Optional, Tuple

from npu_flashrl.adapters.vllm_ascend.schemes.base import UnsupportedScheme

GATE_UP = "w13"
DOWN = "w2"


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
