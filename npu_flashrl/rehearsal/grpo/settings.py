"""The run sizes of `rehearse --grpo` (default) and `--grpo --quick` (CI), chosen for the time budget:
default <= 3 min, quick < 60 s on a 2-core CPU with the tiny model cached (see the README)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

VARIANT_BF16 = "bf16"
VARIANT_INT8 = "int8"
VARIANT_INT8_TIS = "int8+tis"
VARIANT_INT8_TIS_FP32HEAD = "int8+tis+fp32head"
VARIANTS = (VARIANT_BF16, VARIANT_INT8, VARIANT_INT8_TIS, VARIANT_INT8_TIS_FP32HEAD)
# variant -> (rollout model, TIS in the loss, fp32 lm head on both sides)
VARIANT_SPEC = {VARIANT_BF16: ("bf16", False, False), VARIANT_INT8: ("int8", False, False),
                VARIANT_INT8_TIS: ("int8", True, False), VARIANT_INT8_TIS_FP32HEAD: ("int8+fp32head", True, True)}


@dataclasses.dataclass(frozen=True)
class GrpoSettings:
    steps: int            # GRPO steps (one weight sync each) per run
    seeds: int            # runs per variant
    prompts: int          # prompts per step (the same across variants)
    group: int            # responses per prompt (GRPO group size n)
    prompt_len: int
    response_len: int
    lr: float             # AdamW on the fp32 masters
    mini_batches: int     # optimizer steps per GRPO step (one PPO epoch)
    window: int           # steps averaged for "first" and "final" rewards

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS = {
    "default": GrpoSettings(steps=12, seeds=3, prompts=16, group=8, prompt_len=4, response_len=3, lr=3e-3,
                            mini_batches=2, window=3),
    "quick": GrpoSettings(steps=6, seeds=2, prompts=16, group=8, prompt_len=4, response_len=3, lr=3e-3,
                          mini_batches=2, window=2),
}


def resolve(args) -> GrpoSettings:
    """The preset (`--quick` or default) with `--steps`, `--seeds` and `--step-lr` applied when given."""
    s = PRESETS["quick" if getattr(args, "quick", False) else "default"]
    changes: Dict[str, Any] = {}
    if getattr(args, "steps", None) is not None:
        changes["steps"] = args.steps
    if getattr(args, "seeds", None) is not None:
        changes["seeds"] = args.seeds
    if getattr(args, "step_lr", None) is not None:
        changes["lr"] = args.step_lr
    s = dataclasses.replace(s, **changes)
    if s.window * 2 > s.steps:
        s = dataclasses.replace(s, window=max(1, s.steps // 2))
    return s
