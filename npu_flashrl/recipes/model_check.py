"""The model's own limits, read from its config.json before anything launches (`preflight
launch`): what vLLM would refuse only at engine start, after Ray and the trainer are up.

* the context: data.max_prompt_length + data.max_response_length (what verl hands vLLM as
  max_model_len when actor_rollout_ref.rollout.max_model_len is unset) against the model's
  max_position_embeddings, scaled by its rope_scaling factor as vLLM's `_get_and_verify_max_len`
  scales it (vllm/config/model.py; not for the su / longrope / llama3 rope types, which it leaves);
  vLLM refuses a longer max_model_len unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1;
* `architectures`: present, a list, and covered by npu_flashrl's INT8 rollout tests on the recipe's
  stack line (npu_flashrl/architectures.py: `coverage_problem`, and the lines its tests run on).

Torch-free: json only.
"""
from __future__ import annotations

import json
import os
from typing import Any, List, Optional, Tuple

from npu_flashrl import architectures
from npu_flashrl.lines import LINES

# the recipe lines by the vllm-ascend release of their stack (LINES: oldest first)
STACK_OF = {"pinned": LINES[0].name, "current": LINES[-1].name}
UNSCALED_ROPE = ("su", "longrope", "llama3")


def _integer(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def max_positions(config: dict) -> Tuple[Optional[int], str]:
    """(the longest context vLLM derives from a HF config, how it was read)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    base = _integer(text.get("max_position_embeddings"))
    if base is None:
        return None, ""
    how = f"max_position_embeddings={base}"
    rope = text.get("rope_scaling")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind not in UNSCALED_ROPE and isinstance(factor, (int, float)) and not isinstance(factor, bool):
            if kind == "yarn" and _integer(rope.get("original_max_position_embeddings")):
                base = rope["original_max_position_embeddings"]
                how = f"original_max_position_embeddings={base}"
            return int(base * factor), f"{how} x rope_scaling factor {factor:g} ({kind})"
    return base, how


def check(model_dir: str, context: Optional[int], line: str, environ) -> Tuple[List[str], List[str]]:
    """(problems, notes) of the model at `model_dir` for a context of `context` tokens on recipe
    line `line` (pinned / current)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return [], []  # the recipe's own input checks name a missing model directory or config.json
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [f"{path}: not a readable JSON config ({exc}); vLLM and verl read the model's config from it"], []
    if not isinstance(config, dict):
        return [f"{path}: expected a JSON object (the model's HF config), got {type(config).__name__}"], []
    problems: List[str] = []
    notes: List[str] = []
    limit, how = max_positions(config)
    if context and limit and context > limit:
        allowed = str(environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "")).strip().lower() in ("1", "true")
        text = (f"MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH = {context} tokens (data.max_prompt_length + "
                f"data.max_response_length, vLLM's max_model_len) exceed the model's {limit} ({how} in {path})")
        if allowed:
            notes.append(text + "; VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets vLLM run past it (outputs may be wrong)")
        else:
            problems.append(text + ": vLLM refuses such a max_model_len at engine start; shorten the lengths, "
                            "or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if the model really takes longer inputs")
    archs = config.get("architectures")
    if archs is None:
        notes.append(f"{path} has no `architectures`: vLLM cannot tell which model class to build from it, and "
                     "npu_flashrl cannot say whether the INT8 rollout covers the model")
        return problems, notes
    if isinstance(archs, str) or not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        problems.append(f"{path}: `architectures` must be a list of class names (e.g. [\"Qwen2ForCausalLM\"]), "
                        f"got {archs!r}")
        return problems, notes
    name = archs[0]
    stack = STACK_OF.get(line, line)
    gap = architectures.coverage_problem(name)
    arch = architectures.covered(name)
    if gap:
        notes.append(gap)
    if arch is not None and stack not in arch.lines:
        notes.append(f"architecture {name}: its INT8 rollout tests run on the {', '.join(arch.lines)} stack "
                     f"line(s), not on this recipe's ({stack}): not verified on this line")
    return problems, notes
