"""The preflight's look at a W4A8 rollout's group size against the model and the rollout's
tensor-parallel split (`preflight launch`, recipe dry runs).

vllm-ascend's W4A8_DYNAMIC linear layer sizes `weight_scale_second` as [out, in_per_rank //
group_size], and a row-parallel projection (`o_proj`, `down_proj`) holds in / TP input channels
per rank: a group size that does not divide that is refused by the scheme at engine build
(`W4A8DynamicLinear.check_target`), after Ray, the trainer and the model load are up. `setup`
sees full input dims only (it does not know the rollout's TP); the launch command does.

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


def _int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _default_group_size() -> int:
    from npu_flashrl.quant.registry import QUANTIZERS

    return QUANTIZERS[W4A8_FN].default_group_size


def group_sizes(checker) -> List[Tuple[int, str]]:
    """(group size, where it comes from) of every W4A8 entry in play (empty: no W4A8 rollout)."""
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
                elif _int(given) and given > 0:
                    found.append((given, f"{path}: configs[{i}].group_size"))
                # 0 (per-channel: W4A8 experts only, no linear groups to fit) is dropped; anything else is
                # not a group size at all: `config_check` names the key (never the default in its place)
        return found
    env = checker.environ
    if env.get("FLASHRL_FN") != W4A8_FN and env.get("ROLLOUT_PRECISION") != "w4a8":
        return []
    for word in str(env.get("SETUP_EXTRA", "")).split():
        key, _, value = word.partition("=")
        if key == "group_size" and value.isdigit() and int(value) > 0:
            return [(int(value), f"SETUP_EXTRA={env.get('SETUP_EXTRA')}")]
        if key == "group_size":  # 0: no linear groups to fit; else no group size: `setup_extra_problem` names it
            return []
    return [(_default_group_size(), "npu-flashrl setup's default group size (SETUP_EXTRA sets none)")]


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
    """Input dims of the row-parallel projections vLLM splits over TP ranks, from a HF config."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    dims = {}
    hidden, heads = _int(text.get("hidden_size")), _int(text.get("num_attention_heads"))
    head_dim = _int(text.get("head_dim")) or (hidden // heads if hidden and heads else None)
    if heads and head_dim:
        dims["o_proj"] = heads * head_dim
    if _int(text.get("intermediate_size")):
        dims["down_proj"] = text["intermediate_size"]
    return dims


def problems(checker) -> List[str]:
    """A W4A8 rollout's group sizes that leave a remainder on a row-parallel projection's rank."""
    sizes = group_sizes(checker)
    path = checker.flashrl_config()
    if not (path and os.path.isfile(path)) and (checker.environ.get("FLASHRL_FN") == W4A8_FN
                                                or checker.environ.get("ROLLOUT_PRECISION") == "w4a8"):
        problem = setup_extra_problem(checker)
        if problem:
            return [problem]
    model = checker.get("actor_rollout_ref.model.path")
    if not sizes or model is None:
        return []
    path = os.path.join(str(model), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return []  # model_check names an unreadable config.json
    dims = row_parallel_inputs(config) if isinstance(config, dict) else {}
    tp = _int(checker.get(TP_KEY)) or 1
    parts = {proj: full // tp for proj, full in dims.items() if full % tp == 0}
    if not parts:
        return []
    common = math.gcd(*parts.values())
    fits = min(common & -common, _default_group_size())  # the largest power of two dividing all, up to the default
    found = []
    for size, where in sizes:
        bad = [f"{proj} {dims[proj]} input channels ({part} per rank)" for proj, part in parts.items() if part % size]
        if bad:
            found.append(
                f"group_size {size} ({where}) does not divide the model's row-parallel input dims at rollout "
                f"tensor-parallel size {tp} ({TP_KEY}; {path}): {', '.join(bad)}; vllm-ascend's W4A8_DYNAMIC "
                f"layer has in_per_rank // group_size scale groups, so the engine build would refuse it after "
                f"launch. Use a group size that divides {common} (e.g. group_size={fits})")
    return found
