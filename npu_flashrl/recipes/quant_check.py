"""The preflight's look at a quantized checkpoint (`preflight launch`, recipe dry runs): an INT8
rollout's checkpoints read per layer / group against the scheme registry and their own tensors,
as `npu-flashrl setup` / `verify` read them (`adapters/vllm_ascend/description_check.py`).

A bf16 model costs nothing here: whether a directory is quantized is read from its file names and
config.json (json only); torch and the scheme registry are imported only for a quantized one.
"""
from __future__ import annotations

import json
import os
from typing import List, Tuple


def _quantized_checkpoint(model_dir: str) -> bool:
    """`model_dir` carries a quant description (ModelSlim json, or a config.json
    `quantization_config`): read without importing torch, so a bf16 model costs the dry run nothing."""
    if os.path.isfile(os.path.join(model_dir, "quant_model_description.json")):
        return True
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return False  # model_check names an unreadable config.json
    return isinstance(config, dict) and bool(config.get("quantization_config") or config.get("compression_config"))


def checkpoint_problems(checker) -> Tuple[List[str], List[str]]:
    """An INT8 rollout's quantized checkpoints (the actor's model path, and the FlashRL config
    entries' `model`) read per layer / group against the scheme registry and their own tensors, as
    `npu-flashrl setup` / `verify` read them (`description_check`)."""
    if not checker.int8_rollout():
        return [], []
    models = [checker.get("actor_rollout_ref.model.path")] + _flashrl_models(checker.flashrl_config())
    problems: List[str] = []
    notes: List[str] = []
    for model in dict.fromkeys(str(m).strip() for m in models if m is not None and str(m).strip()):
        if not os.path.isdir(model) or not _quantized_checkpoint(model):
            continue
        from npu_flashrl.adapters.vllm_ascend.description_check import description_problems

        found, more = description_problems(model)
        problems += [f"model {model}: {p}" for p in found]
        notes += more
    return problems, notes


def _flashrl_models(path: str) -> List[str]:
    """The `model` of each non-bf16 entry of the FlashRL config at `path` (none when unreadable:
    `npu-flashrl verify` reports a broken config)."""
    if not path or not os.path.isfile(path):
        return []
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        return []
    entries = [data] if isinstance(data, dict) and "fn" in data else (
        data.get("configs") if isinstance(data, dict) else None)
    return [str(e["model"]) for e in entries or []
            if isinstance(e, dict) and e.get("model") and str(e.get("fn")) != "bf16"]
