"""The model architectures the INT8 rollout is verified for, in one place.

`npu-flashrl setup` / `verify` and the engine build (the INT8 loader's attach) look a model's
architecture up here and, for one that is not covered, say so and what was verified instead,
rather than letting a later weight sync be the first thing to find out. docs/compatibility.md's
architectures table is this table (a test keeps them equal), and every cell names the test that
backs it. Pure data: no upstream import (the adapters and the CLI both read it).

Cells: "yes"; "no" (with why); "n/a"; "partial" (the note says which part).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Dict, List, Optional, Tuple

from npu_flashrl.lines import LINES

logger = logging.getLogger(__name__)

COLUMNS = ("cold_load", "sync", "wire", "megatron_export", "moe", "cpu_forward")
HEADERS = ("cold INT8 load", "in-place sync", "INT8 wire", "Megatron export", "MoE", "forward on CPU")


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str                      # HF config `architectures[0]` (= vLLM's model class name)
    family: str                    # short name (e.g. the rehearsal's model family)
    cells: Tuple[str, ...]         # one per COLUMNS
    tests: Tuple[str, ...]         # the tests behind the cells
    lines: Tuple[str, ...]         # stack lines the tests run on (their vllm-ascend releases)
    note: str = ""

    def cell(self, column: str) -> str:
        return self.cells[COLUMNS.index(column)]

    def summary(self) -> str:
        parts = [f"{h}: {c}" for h, c in zip(HEADERS, self.cells)]
        return f"{self.name} ({', '.join(parts)}; lines {', '.join(self.lines)})"


def _arch(name, family, cold_load, sync, wire, megatron_export, moe, cpu_forward, tests, lines, note=""):
    return Architecture(name, family, (cold_load, sync, wire, megatron_export, moe, cpu_forward),
                        tuple(tests), tuple(lines), note)


# the stack lines by their vllm-ascend release (oldest first: pinned, the middle line, current)
_ALL = tuple(ln.name for ln in LINES)
_NEWER, _CURRENT = _ALL[1:], _ALL[-1:]

MBRIDGE_UNTESTED = "no: mbridge has a bridge, not tested here"
# tests/adapters/megatron/test_megatron_engine_archs.py holds this refusal to what the engine does
DEEPSEEK_MEGATRON = ("no: the current line's verl engine builds mbridge 0.15.1's DeepseekV3Bridge before it sets "
                     "hf_config.rope_theta, and transformers 5's DeepseekV3Config has none (it is in "
                     "rope_parameters): the bridge fails with AttributeError 'rope_theta'")
_VL_NOTE = ("language model's projections W8A8_DYNAMIC, vision tower and merger 16-bit; vLLM's "
            "hf_to_vllm_mapper honoured (trainer names model.language_model.* / model.visual.*, "
            "checkpoint names model.* / visual.*); an image prompt through the rollout after a "
            "sync (current line only: vLLM's VL models import torchvision).")

COVERED: Tuple[Architecture, ...] = (
    _arch("Qwen2ForCausalLM", "qwen2", "yes", "yes", "yes", "yes", "n/a", "yes",
          ("tests/adapters/vllm_ascend/test_vllm_ascend_buckets.py", "tests/adapters/vllm_ascend/test_int8_wire.py",
           "tests/adapters/megatron/test_megatron_engine.py", "tests/adapters/vllm_ascend/test_vllm_ascend_sync.py"),
          _ALL, "tied and untied embeddings"),
    _arch("Qwen3ForCausalLM", "qwen3", "yes", "yes", "no: not tested (same projection names as Qwen2)",
          MBRIDGE_UNTESTED, "n/a", "no: not tested", ("tests/adapters/vllm_ascend/test_vllm_ascend_buckets.py",),
          _ALL),
    _arch("Qwen3MoeForCausalLM", "qwen3_moe", "yes", "yes", "yes", "yes", "yes", "yes",
          ("tests/adapters/vllm_ascend/test_moe_reload.py", "tests/adapters/vllm_ascend/test_int8_wire.py", "tests/adapters/vllm_ascend/test_moe_forward.py",
           "tests/adapters/megatron/test_megatron_engine.py"), _ALL),
    _arch("LlamaForCausalLM", "llama", "yes", "yes", "yes (receiving end)", "yes (current line)", "n/a", "yes",
          ("tests/models/test_models_llama.py", "tests/adapters/megatron/test_megatron_engine_archs.py"), _NEWER,
          "Llama 3.x: no bias, GQA, llama3 rope scaling, tied embeddings"),
    _arch("DeepseekV3ForCausalLM", "deepseek_v3", "yes", "yes",
          "yes (receiving end; MLA and shared-expert projections travel float)", DEEPSEEK_MEGATRON,
          "yes", "yes (MLA attention through a plain-torch stand-in)",
          ("tests/models/test_models_deepseek_v3.py", "tests/kernels/test_emulation_shared_experts.py"),
          _CURRENT,
          "MLA projections W8A8_DYNAMIC, kv_b_proj 16-bit (vllm-ascend's MLA asserts it) with its "
          "absorbed W_UK_T / W_UV re-derived after each sync; router + correction bias high precision; "
          "shared experts and the first dense layers quantized. The MoE layers run the current line's vllm-ascend "
          "forward on emulated kernels (the shared experts' swiglu_mode=1 kernel: not verified on "
          "hardware); the attention forward on the CPU is a plain-torch stand-in for vllm-ascend's "
          "NPU MLA kernels."),
    _arch("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "yes", "yes", "yes", MBRIDGE_UNTESTED, "n/a",
          "yes", ("tests/models/test_models_qwen_vl.py",), _CURRENT, _VL_NOTE),
    _arch("Qwen3VLForConditionalGeneration", "qwen3_vl", "yes", "yes", "yes", MBRIDGE_UNTESTED, "n/a",
          "yes", ("tests/models/test_models_qwen_vl.py",), _CURRENT, _VL_NOTE + " Deepstack mergers 16-bit too."),
)

# Architectures looked at and not covered, with why (anything else: not looked at).
NOT_COVERED: Dict[str, str] = {
    "Qwen3VLMoeForConditionalGeneration":
        "not tried: Qwen3-VL's MoE sizes (30B-A3B, 235B-A22B) combine the VL name mapping "
        "(tested on the dense Qwen3-VL) with fused-MoE experts under language_model.*; no tiny "
        "model of it is built here",
}


def covered(name: Optional[str]) -> Optional[Architecture]:
    for a in COVERED:
        if a.name == name:
            return a
    return None


def families() -> List[str]:
    return [a.family for a in COVERED]


def model_architecture(model_dir: str) -> Optional[str]:
    """`architectures[0]` of a local checkpoint's config.json (None: no readable config)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return archs[0] if archs else None


def coverage_problem(name: Optional[str]) -> Optional[str]:
    """None when `name` is fully covered; else what is not covered and what was verified."""
    a = covered(name)
    verified = "; ".join(x.name for x in COVERED)
    if a is None:
        why = NOT_COVERED.get(name or "", "not among the architectures npu_flashrl's tests build")
        return (f"architecture {name or '(unknown)'} is not covered by npu_flashrl's INT8 rollout "
                f"tests ({why}); verified instead: {verified} (docs/compatibility.md, Architectures). "
                "The INT8 loader still refuses any layer it cannot serve by name at engine build")
    gaps = [f"{h}: {c}" for h, c in zip(HEADERS, a.cells) if not c.startswith(("yes", "n/a"))]
    if gaps:
        return f"architecture {a.name} is covered in part ({'; '.join(gaps)}); {a.note}"
    return None


def installed_line():
    """The installed stack line (`lines.current()`), else the line pins.yaml matches, else None
    (setup and verify run where the stack may be partly installed)."""
    from npu_flashrl.lines import by_label, current

    try:
        return current()
    except Exception:  # noqa: BLE001 - no vllm-ascend here: try the pins
        pass
    try:
        from npu_flashrl import pins

        name, _ = pins.match_line()
        return by_label(name) if name else None
    except Exception:  # noqa: BLE001
        return None


def line_refusal(name: Optional[str], line=None) -> Optional[str]:
    """Why the stack line (`line`, default the installed one) refuses an INT8 rollout of `name`."""
    line = line if line is not None else installed_line()
    return line.architecture_refusal(name) if line is not None and name else None


def refuse_on_line(name: Optional[str], where: str, line=None) -> None:
    """Raise `ArchitectureRefusedError` (prefixed with `where`) when the line refuses `name`."""
    from npu_flashrl.errors import ArchitectureRefusedError

    why = line_refusal(name, line)
    if why:
        raise ArchitectureRefusedError(f"{where}: {why}")


def warn_if_not_covered(name: Optional[str], where: str) -> Optional[str]:
    """Log (WARNING) and return `coverage_problem(name)`, prefixed with `where`."""
    problem = coverage_problem(name)
    if problem:
        logger.warning("%s: %s", where, problem)
    return problem


def table_markdown() -> str:
    """The docs/compatibility.md architectures table."""
    head = "| architecture | " + " | ".join(HEADERS) + " | vllm-ascend lines | tests |"
    rows = [head, "|" + "---|" * (len(HEADERS) + 3)]
    for a in COVERED:
        rows.append(f"| {a.name} | " + " | ".join(a.cells) + f" | {', '.join(a.lines)} | "
                    + ", ".join(f"`{t}`" for t in a.tests) + " |")
    for name, why in NOT_COVERED.items():
        rows.append(f"| {name} | " + " | ".join(["no"] * len(HEADERS)) + f" | - | not covered: {why} |")
    return "\n".join(rows)
