"""A quantized checkpoint's description, read per layer before anything launches (`setup`,
`verify`, the recipes' preflight): what the engine would refuse only at build, or worse, build and
run wrong.

* A ModelSlim `quant_model_description.json`: every `<layer>.weight` it types is checked
  - against the scheme registry: a quantized type is one the INT8 rollout's in-place reload writes
    on the installed line (`schemes.registered()`, each scheme's class read by key from the line's
    own vllm-ascend table, `StackLine.method_class`); a type this vllm-ascend has no scheme for
    (an unknown one) is refused as vllm-ascend's `create_scheme_for_layer` would refuse it, a type
    it has but the reload does not write (W8A16, ...) as `schemes.find_targets` would at build;
  - against its own tensors, from the safetensors headers (no tensor data is read): a layer typed
    FLOAT whose weight is int8 would run int8 values as floats (garbage out); a quantized layer's
    tensors must fit its scheme's checkpoint contract (`Scheme.checkpoint.header_problem`: int8
    weight, one scale per output row).
* A compressed-tensors `quantization_config`: the translation the engine build runs
  (`description.describe_checkpoint`), which names the config group it refuses (4-bit weights,
  weight-only int8, ...).

Each problem names the layer (or the group) and the file.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

from npu_flashrl.adapters.vllm_ascend.description import (
    DESCRIPTION_FILE, FLOAT, describe_checkpoint, read_hf_quant_config)
from npu_flashrl.adapters.vllm_ascend.schemes import LINEAR, MOE, UnsupportedScheme, registered
from npu_flashrl.checkpoint import SafetensorsCheckpoint
from npu_flashrl.errors import ProfileError

_EXPERT = re.compile(r"\.experts\.\d+\.")


def layer_type(weight_name: str) -> str:
    """vllm-ascend's layer type of a described weight: a routed expert's belongs to the fused-MoE
    layer ("moe"), everything else is a linear layer."""
    return MOE if _EXPERT.search(weight_name) else LINEAR


def read_description(model_dir: str) -> Optional[dict]:
    """The ModelSlim description of `model_dir` (None: it has none)."""
    path = os.path.join(model_dir, DESCRIPTION_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnsupportedScheme(f"{path}: not a readable JSON description ({exc})") from None
    if not isinstance(data, dict):
        raise UnsupportedScheme(f"{path}: expected a JSON object (tensor name -> quant type), "
                                f"got {type(data).__name__}")
    return data


def reload_keys(line=None) -> Dict[Tuple[str, str], str]:
    """(quant type, layer type) -> vllm-ascend class name, for every scheme the in-place reload
    writes on `line` (default: the installed one). Imports vllm-ascend's quantization package
    (raises what that import raises)."""
    from npu_flashrl import lines

    line = line or lines.current()
    keys = {}
    for scheme in registered():
        cls = scheme.method_class(line)
        if cls is not None:
            keys[scheme.key] = cls.__name__
    return keys


def _registry_problem(module: str, quant_type: str, kind: str, keys, line) -> Optional[str]:
    if (quant_type, kind) in keys:
        return None
    shown = ", ".join(f"{qt}/{lt}" for qt, lt in sorted(keys)) or "none"
    if line is None:  # the line's table unread: npu_flashrl's own registry still refuses it
        return (f"layer {module} is typed {quant_type!r} ({kind}): the INT8 rollout's in-place reload has "
                f"no scheme for it (refused at engine build); it has {shown}")
    upstream = line.method_class(quant_type, kind)
    if upstream is None:
        return (f"layer {module} is typed {quant_type!r} ({kind}): vllm-ascend {line.vllm_ascend} has no "
                f"such scheme (its engine refuses the layer at build); the INT8 rollout writes {shown}")
    return (f"layer {module} is typed {quant_type!r} ({kind}): vllm-ascend {line.vllm_ascend} runs it as "
            f"{upstream.__name__}, which the INT8 rollout's in-place reload does not write (refused at "
            f"engine build); it writes {shown}")


def modelslim_problems(model_dir: str, desc: dict, limit: int = 5) -> Tuple[List[str], List[str]]:
    """(problems, notes) of a ModelSlim description against the registry and the checkpoint's own
    tensors (headers only)."""
    path = os.path.join(model_dir, DESCRIPTION_FILE)
    notes: List[str] = []
    try:
        from npu_flashrl import lines

        line = lines.current()
        keys = reload_keys(line)
    except Exception as exc:  # no vllm-ascend importable here (a CPU host without torch_npu, ...)
        line, keys = None, None
        notes.append(f"{path}: quant types checked against npu_flashrl's schemes only, not against the "
                     "installed vllm-ascend's scheme table "
                     f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                     "run `npu-flashrl verify` where the rollout runs")
    schemes = {s.key: s for s in registered()}
    problems: List[str] = []
    try:
        ckpt = SafetensorsCheckpoint(model_dir)
    except ProfileError as exc:
        return [str(exc)], notes
    try:
        def header(name: str):
            return (ckpt.dtype(name), ckpt.shape(name)) if name in ckpt else None

        for key in sorted(desc):
            quant_type = desc[key]
            if not key.endswith(".weight") or len(problems) >= limit:
                continue
            module = key[: -len(".weight")]
            if not isinstance(quant_type, str):
                problems.append(f"{path}: {key} = {quant_type!r}: expected a quant type string "
                                "(FLOAT, W8A8, W8A8_DYNAMIC, ...)")
                continue
            if quant_type == FLOAT:
                got = header(key)
                if got is not None and got[0] == "I8":
                    problems.append(
                        f"{path}: layer {module} is typed FLOAT but {key} is int8 in {ckpt.files[key]}: "
                        "vllm-ascend would run its int8 values as float weights and generate garbage; "
                        "type the layer with the scheme it was quantized with (W8A8 / W8A8_DYNAMIC)")
                continue
            kind = layer_type(key)
            problem = _registry_problem(module, quant_type, kind, schemes if keys is None else keys, line)
            if problem:
                problems.append(f"{path}: {problem}")
                continue
            scheme = schemes[(quant_type, kind)]
            problem = scheme.checkpoint.header_problem(key, header)
            if problem:
                problems.append(f"{path}: layer {module} is typed {quant_type}, but {problem} "
                                f"({model_dir}); re-export the checkpoint or fix its description")
        undescribed = [n for n in sorted(ckpt.names())
                       if n.endswith(".weight") and n not in desc and ckpt.dtype(n) == "I8"]
        if undescribed:  # a note: a layer vLLM does not build (DeepSeek's MTP layer) is never looked up
            notes.append(f"{path}: {undescribed[0]} (int8 in {ckpt.files[undescribed[0]]}) is not in the "
                         f"description ({len(undescribed)} such weight(s)): vllm-ascend refuses a layer it builds "
                         "whose weight the description lacks (KeyError at engine build); add it with its "
                         "quant type unless vLLM does not build that layer")
    finally:
        ckpt.close()
    return problems, notes


def description_problems(model_dir: str, limit: int = 5) -> Tuple[List[str], List[str]]:
    """(problems, notes) of the quant description the engine will read for `model_dir`: a ModelSlim
    description per layer, a compressed-tensors config per group; a bf16 checkpoint has none."""
    try:
        desc = read_description(model_dir)
        if desc is not None:
            return modelslim_problems(model_dir, desc, limit)
        if read_hf_quant_config(model_dir) is None:
            return [], []
        describe_checkpoint(model_dir)
    except (UnsupportedScheme, ValueError, OSError) as exc:
        return [str(exc)], []
    return [], []
