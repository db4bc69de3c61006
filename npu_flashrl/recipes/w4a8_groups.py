"""The preflight's look at a W4A8 rollout's group size against the model and the rollout's
tensor-parallel / expert-parallel split (`preflight launch`, recipe dry runs).

vllm-ascend's W4A8_DYNAMIC linear layer sizes `weight_scale_second` as [out, in_per_rank //
group_size], and a row-parallel projection (`o_proj`, `down_proj`) holds in / TP input channels
per rank: a group size that does not divide that is refused by the scheme at engine build
(`W4A8DynamicLinear.check_target`), after Ray, the trainer and the model load are up. `setup`
sees full input dims only (it does not know the rollout's TP); the launch command does.

A MoE model's routed experts (vllm-ascend's W4A8_DYNAMIC fused-MoE layer: `w2_weight_scale_second`
[E, hidden, intermediate_size_per_partition // group_size]) hold moe_intermediate / TP input
channels of their down projection per rank with expert parallel off, whole experts with it on
(EP > 1); their gate/up input (hidden) is never split. They run the A8W4 grouped matmul, which takes
quantGroupSize 256 only (`kernels/op_rules_int4.A8W4_QUANT_GROUP`, its page cited there), and a
bf16 checkpoint's in-memory description gives every layer one group size: so 256, dividing every
per-rank input dim. Group size 0 (per-channel) from a bare bf16 checkpoint is refused (the
in-memory description types every projection W4A8_DYNAMIC, whose linear method has no
per-channel mode). A ModelSlim checkpoint at the model path is read for its own group size and
its W4A8_DYNAMIC layers (`w4a8_checkpoint.read_description`; that import pulls torch, as
`quant_check` does for a quantized checkpoint).

The group size comes from the FlashRL config's `w4a8_profile_free` entries (their `group_size`,
else the quantizer's default) or, before `npu-flashrl setup` wrote that config, from the recipe's
`SETUP_EXTRA` (`group_size=N`). Json and yaml only, unless a W4A8 rollout is in play.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Tuple

W4A8_FN = "w4a8_profile_free"
TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
EP_KEY = "actor_rollout_ref.rollout.expert_parallel_size"
# the A8W4 grouped matmul's only group (kernels/op_rules_int4.A8W4_QUANT_GROUP, torch-free here;
# tests/recipes/test_recipes_w4a8_moe.py holds the two together)
A8W4_GROUP = 256


def _int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _default_group_size() -> int:
    from npu_flashrl.quant.registry import QUANTIZERS

    return QUANTIZERS[W4A8_FN].default_group_size


def _entries(checker) -> List[Tuple[int, str]]:
    """(group size, where it comes from) of every W4A8 entry in play, 0 (per-channel) included
    (empty: no W4A8 rollout)."""
    path = checker.flashrl_config()
    if path and os.path.isfile(path):
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
            return []  # `npu-flashrl verify` names a broken config
        entries = [data] if isinstance(data, dict) and "fn" in data else (
            data.get("configs") if isinstance(data, dict) else None)
        found = []
        for i, entry in enumerate(entries or []):
            # the fn read stripped, as npu_flashrl's config reader reads it
            if isinstance(entry, dict) and str(entry.get("fn")).strip() == W4A8_FN:
                given = entry.get("group_size")
                if given is None:
                    found.append((_default_group_size(), f"{path}: configs[{i}] (the default group size)"))
                elif _int(given) is not None and given >= 0:
                    found.append((given, f"{path}: configs[{i}].group_size"))
                # anything else is no group size at all: `config_check` names the key (never the
                # default in its place)
        return found
    env = checker.environ
    if env.get("FLASHRL_FN") != W4A8_FN and env.get("ROLLOUT_PRECISION") != "w4a8":
        return []
    for word in str(env.get("SETUP_EXTRA", "")).split():
        key, _, value = word.partition("=")
        if key == "group_size" and value.isdigit():
            return [(int(value), f"SETUP_EXTRA={env.get('SETUP_EXTRA')}")]
        if key == "group_size":  # no group size: `setup_extra_problem` names it
            return []
    return [(_default_group_size(), "npu-flashrl setup's default group size (SETUP_EXTRA sets none)")]


def group_sizes(checker) -> List[Tuple[int, str]]:
    """(group size, where it comes from) of every W4A8 entry in play with groups to fit (0,
    per-channel, has none)."""
    return [(s, where) for s, where in _entries(checker) if s > 0]


def _text(config: dict) -> dict:
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def experts(config: dict) -> Optional[Tuple[int, int]]:
    """(hidden size, expert intermediate size) of a MoE model's routed experts from its HF config
    (Qwen3-MoE / DeepSeek: `moe_intermediate_size`; Mixtral: `intermediate_size` beside
    `num_local_experts`); None for a dense model."""
    text = _text(config)
    hidden = _int(text.get("hidden_size"))
    if not (_int(text.get("num_experts")) or _int(text.get("n_routed_experts"))
            or _int(text.get("num_local_experts"))) or not hidden:
        return None
    inter = _int(text.get("moe_intermediate_size"))
    if inter is None and _int(text.get("num_local_experts")):
        inter = _int(text.get("intermediate_size"))
    return (hidden, inter) if inter else None


def _dense_mlp(text: dict) -> bool:
    """A MoE model keeps dense MLP layers (whose down_proj is `intermediate_size` wide)."""
    step = _int(text.get("decoder_sparse_step"))
    return bool(text.get("mlp_only_layers")) or (step is not None and step > 1) or \
        bool(_int(text.get("first_k_dense_replace")))


def setup_extra_problem(checker) -> Optional[str]:
    """A `group_size=` in SETUP_EXTRA (what the entry passes to `npu-flashrl setup`) that is no
    group size (not a positive integer, nor 0 for per-channel experts): setup would refuse it after
    the dry run said nothing."""
    extra = checker.environ.get("SETUP_EXTRA")
    for word in str(extra or "").split():
        key, _, value = word.partition("=")
        if key == "group_size" and not value.isdigit():
            return (f"SETUP_EXTRA={extra}: group_size={value}: expected a positive integer (input channels "
                    f"per W4A8 scale group) or 0 (per-channel, W4A8 fused-MoE experts only); npu-flashrl setup "
                    f"refuses anything else, e.g. group_size=128")
    return None


def row_parallel_inputs(config: dict) -> Dict[str, int]:
    """Input dims of the row-parallel projections vLLM splits over TP ranks, from a HF config (a
    MoE model's dense down_proj only when it keeps dense MLP layers)."""
    text = _text(config)
    dims = {}
    hidden, heads = _int(text.get("hidden_size")), _int(text.get("num_attention_heads"))
    head_dim = _int(text.get("head_dim")) or (hidden // heads if hidden and heads else None)
    if heads and head_dim:
        dims["o_proj"] = heads * head_dim
    if _int(text.get("intermediate_size")) and (experts(config) is None or _dense_mlp(text)):
        dims["down_proj"] = text["intermediate_size"]
    return dims


def per_rank_inputs(config: dict, tp: int, ep: int) -> Dict[str, Tuple[int, int]]:
    """{projection: (input dim, per-rank input dim)} under rollout TP `tp` and expert-parallel size
    `ep`: o_proj / down_proj hold in / TP; a MoE model's routed experts are split over the TP ranks
    (vLLM's FusedMoE intermediate_size_per_partition = moe_intermediate / TP) unless expert
    parallel is on (EP > 1: each rank holds whole experts); their gate/up input (hidden) is never
    split. A dim TP does not divide is left out (verl / vLLM refuse that TP)."""
    dims = {proj: (full, full // tp) for proj, full in row_parallel_inputs(config).items() if full % tp == 0}
    moe = experts(config)
    if moe:
        hidden, inter = moe
        split = 1 if ep > 1 else tp
        if inter % split == 0:
            dims["experts' down_proj"] = (inter, inter // split)
        dims["experts' gate_up_proj"] = (hidden, hidden)
    return dims


def _model_description(model: str):
    """(path, description) of the ModelSlim checkpoint at `model` (None: none there), read by
    `w4a8_checkpoint` (which imports torch: only for such a checkpoint); ValueError: unreadable."""
    from_file = os.path.join(model, "quant_model_description.json")
    if not os.path.isfile(from_file):
        return None
    from npu_flashrl import w4a8_checkpoint

    return from_file, w4a8_checkpoint.read_description(model)


def _kind(module: str) -> Optional[str]:
    """The `per_rank_inputs` key of a W4A8_DYNAMIC module of a ModelSlim description."""
    leaf = module.rsplit(".", 1)[-1]
    if ".experts." in module:
        return "experts' down_proj" if leaf in ("down_proj", "w2") else "experts' gate_up_proj"
    if "shared_expert" in module:
        return None  # its own intermediate size: `setup` checks its full input dim
    return leaf if leaf in ("o_proj", "down_proj") else None


def problems(checker) -> List[str]:
    """A W4A8 rollout's group sizes that leave a remainder on a row-parallel projection's rank or
    on a routed expert's (or that the experts' A8W4 grouped matmul does not take); group size 0
    from a bare bf16 checkpoint. A ModelSlim checkpoint at the model path is read for its own
    group size and W4A8_DYNAMIC layers."""
    sizes = _entries(checker)
    path = checker.flashrl_config()
    if not (path and os.path.isfile(path)) and (checker.environ.get("FLASHRL_FN") == W4A8_FN
                                                or checker.environ.get("ROLLOUT_PRECISION") == "w4a8"):
        problem = setup_extra_problem(checker)
        if problem:
            return [problem]
    model = checker.get("actor_rollout_ref.model.path")
    if not sizes or model is None:
        return []
    try:
        found = _model_description(str(model))
    except ValueError:
        return []  # quant_check names an unreadable description
    only = None
    if found:
        where, description = found
        from npu_flashrl import w4a8_checkpoint

        size = description.get("group_size", w4a8_checkpoint.DEFAULT_GROUP_SIZE)
        if _int(size) is None or size <= 0:
            return []  # per-channel (experts only: no groups), or a bad value quant_check names
        sizes = [(size, f"{where}: group_size, the checkpoint's own")]
        only = {_kind(m) for m in w4a8_checkpoint.w4a8_modules(description)} - {None}
    elif any(size == 0 for size, _ in sizes):
        from npu_flashrl.quant.w4a8 import bf16_per_channel_problem

        return [f"group_size 0 ({where}) with {model}, a bare bf16 checkpoint (no quant_model_description.json): "
                + bf16_per_channel_problem() for size, where in sizes if size == 0]
    path = os.path.join(str(model), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return []  # model_check names an unreadable config.json
    if not isinstance(config, dict):
        return []
    tp = _int(checker.get(TP_KEY)) or 1
    ep = _int(checker.get(EP_KEY)) or 1
    dims = per_rank_inputs(config, tp, ep)
    if only is not None:
        dims = {proj: d for proj, d in dims.items() if proj in only}
    moe = any(proj.startswith("experts") for proj in dims)
    if not dims:
        return []
    common = math.gcd(*(part for _, part in dims.values()))
    fits = min(common & -common, _default_group_size())  # the largest power of two dividing all, up to the default
    how = "whole experts per rank" if ep > 1 else "experts split over the TP ranks"
    split = f", expert-parallel size {ep} ({EP_KEY}: {how})" if moe else ""
    out = []
    for size, where in sizes:
        bad = [f"{proj} {full} input channels ({part} per rank)" for proj, (full, part) in dims.items() if part % size]
        a8w4 = moe and size != A8W4_GROUP
        if not bad and not a8w4:
            continue
        said = []
        if bad:
            said.append(f"does not divide the model's row-parallel input dims at rollout tensor-parallel size {tp}"
                        f" ({TP_KEY}){split} ({path}): {', '.join(bad)}; vllm-ascend's W4A8_DYNAMIC layer has "
                        "in_per_rank // group_size scale groups, so the engine build would refuse it after launch")
        if a8w4:
            said.append(f"is not {A8W4_GROUP}: the W4A8 fused-MoE experts run the A8W4 grouped matmul "
                        f"(aclnnGroupedMatmulV4), which takes quantGroupSize {A8W4_GROUP} only "
                        "(npu_flashrl/kernels/op_rules_int4.py), and one group size serves every layer")
        if not moe:
            fix = f"Use a group size that divides {common} (e.g. group_size={fits})"
        elif common % A8W4_GROUP == 0:
            fix = f"Use group_size={A8W4_GROUP}"
        else:
            fix = (f"No group size fits the experts at this split ({A8W4_GROUP} must divide every per-rank input "
                   "dim): turn expert parallel on (ROLLOUT_EP = ROLLOUT_TP x ROLLOUT_DP, whole experts per rank) "
                   f"or a ROLLOUT_TP that leaves a multiple of {A8W4_GROUP} of them per rank")
        if only is not None:  # a ModelSlim checkpoint's own group size: re-exported, not set in a config
            fix = fix.replace(f"Use group_size={A8W4_GROUP}", f"Export the checkpoint with group_size {A8W4_GROUP}")
        out.append(f"group_size {size} ({where}) " + "; and it ".join(said) + f". {fix}")
    return out
