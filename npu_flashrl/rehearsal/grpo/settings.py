"""The variants, the controls and the run sizes of `rehearse --grpo` (default) and `--grpo --quick` (CI).

A **variant** is a way to train: which rollout model samples, whether verl's TIS weights enter the
loss, the fp32 lm head. A **negative control** is a variant with one thing deliberately wrong (a
named switch of the rehearsal, `Variant.control`) and the check it must fail: the run passes only
when each control fails its check, so every check shown to pass is one that can fail. Controls whose
check is structural (it sees the fault in every step) run at `CONTROL_SIZE`; the slow learner needs
the statistics of the full size. A **power probe** (`PROBES`) is a variant with a real effect of a
known cause (int8+tis at 0.75x the learning rate): it need not fail, but the detectable difference
printed for the tracked variants must cover its effect unless the run catches it, and its standard
error (with the slow learner's) is the SE under an effect the power is computed with.

Sizes are chosen for the time budget (default within 5 min of CPU time on a 2-core machine,
`--quick` within about 2 min, the tiny model cached; see the README).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

VARIANT_BF16 = "bf16"
VARIANT_INT8 = "int8"
VARIANT_INT8_TIS = "int8+tis"
VARIANT_INT8_TIS_FP32HEAD = "int8+tis+fp32head"
VARIANT_W4A8 = "w4a8"
VARIANT_W4A8_TIS = "w4a8+tis"

# the check names a control is meant to fail (checks.py builds them with these phrases)
CHECK_TIS_RATIO = "TIS weights are the truncated trainer/rollout ratio"
CHECK_TIS_IN_LOSS = "TIS weights in the loss"
CHECK_OWN_LOGP = "rollout log-probs are the rollout model's own"
CHECK_STATE_INT8 = "state: int8 values equal the reference quantization"
CHECK_TRACKS = "trains like bf16 (paired held-out score)"
CHECK_POWER = "power: the detectable difference printed covers a 0.75x-lr learner, or the run catches it"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    rollout: str                    # the rollout model: "bf16", "int8", "int8+fp32head" or "w4a8" (--w4a8)
    tis: bool                       # verl's TIS weights in the loss
    fp32_head: bool = False         # the fp32 lm head on both sides
    control: Optional[str] = None   # negative control: what is deliberately wrong (see CONTROL_EFFECTS)
    lr_scale: float = 1.0
    fails: Optional[str] = None     # negative control: the check it must fail (name with `name: ` before it)
    full_size: bool = True          # False: runs at CONTROL_SIZE
    logit_scale: float = 1.0        # the rollout samples from its logits x this (positive control settings)

    @property
    def int8(self) -> bool:
        """A quantized rollout (INT8 or W4A8: its precision follows from its rollout's fn, `run._setup`)."""
        return self.rollout != "bf16"

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.control:
            d["what"] = CONTROL_EFFECTS[self.control]
        return d


CONTROL_EFFECTS = {
    "tis_inverted": "verl's rollout correction called with the trainer's and the rollout's log-probs swapped: "
                    "weights min(pi_rollout / pi_trainer, 2) instead of min(pi_trainer / pi_rollout, 2)",
    "tis_ones": "TIS weights replaced by 1 after verl computed them (TIS switched on, doing nothing)",
    "logp_from_trainer": "the rollout log-probs handed to verl recomputed by the trainer in fp32 (no bf16 "
                         "autocast): the rollout / trainer mismatch hidden",
    "stale_rollout": "the rollout model gets the trainer's weights one step late (each sync pushes the weights "
                     "from before the step's update)",
    "slow_learner": "int8+tis at a quarter of the learning rate: a learner that lags bf16",
}
PROBE_EFFECT = "int8+tis at 0.75x the learning rate: a small real effect the printed power must cover"

REAL = (
    Variant(VARIANT_BF16, "bf16", tis=False),
    Variant(VARIANT_INT8, "int8", tis=False),
    Variant(VARIANT_INT8_TIS, "int8", tis=True),
    Variant(VARIANT_INT8_TIS_FP32HEAD, "int8+fp32head", tis=True, fp32_head=True),
)
# `--w4a8`: the W4A8 rollout (fn w4a8_profile_free), without and with TIS; reported beside the INT8
# ones (paired with bf16 and TIS against no TIS), not tracked: no verdict rests on them
W4A8_REAL = (
    Variant(VARIANT_W4A8, "w4a8", tis=False),
    Variant(VARIANT_W4A8_TIS, "w4a8", tis=True),
)
# the TIS effects reported beside each other: (with TIS, without)
TIS_PAIRS = ((VARIANT_INT8_TIS, VARIANT_INT8), (VARIANT_W4A8_TIS, VARIANT_W4A8))
CONTROLS = (
    Variant("ctl:tis_inverted", "int8", tis=True, control="tis_inverted", fails=CHECK_TIS_RATIO, full_size=False),
    Variant("ctl:tis_ones", "int8", tis=True, control="tis_ones", fails=CHECK_TIS_IN_LOSS, full_size=False),
    Variant("ctl:logp_from_trainer", "int8", tis=True, control="logp_from_trainer", fails=CHECK_OWN_LOGP,
            full_size=False),
    Variant("ctl:stale_rollout", "int8", tis=True, control="stale_rollout", fails=CHECK_STATE_INT8,
            full_size=False),
    Variant("ctl:slow_learner", "int8", tis=True, control="slow_learner", lr_scale=0.25, fails=CHECK_TRACKS),
)
PROBES = (Variant("probe:lr_x0.75", "int8", tis=True, lr_scale=0.75),)
# the comparisons that carry a real effect: their paired SE is the SE under an effect (the power's)
EFFECT_LEARNERS = ("ctl:slow_learner", "probe:lr_x0.75")
ALL = {v.name: v for v in REAL + W4A8_REAL + CONTROLS + PROBES}
VARIANTS = tuple(v.name for v in REAL)
# the variants whose tracking of bf16 is a verdict (int8 without TIS is shown, compared, not required)
TRACKED = (VARIANT_INT8_TIS, VARIANT_INT8_TIS_FP32HEAD, "ctl:slow_learner")
TRACKED_REAL = tuple(n for n in TRACKED if not n.startswith("ctl:"))
# variant -> (rollout model, TIS in the loss, fp32 lm head on both sides)
VARIANT_SPEC = {v.name: (v.rollout, v.tis, v.fp32_head) for v in ALL.values()}


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
    heldout_prompts: int = 64   # prompts never trained on, scoring each trained policy
    replay_rows: int = 8        # sampled rows per step replayed through the rollout model (own log-probs)
    confidence: float = 0.95    # of the family of tracking comparisons (split over them, Bonferroni)
    controls: bool = True       # the negative controls and the power probe
    positive_control: bool = False  # `--positive-control`: the settings of `positive.SETTINGS` too
    w4a8: bool = False          # `--w4a8`: the W4A8 variants (`W4A8_REAL`) and the positive control's W4A8 setting
    quick: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def size_of(self, v: Variant) -> Tuple[int, int]:
        """(seeds, steps) of variant `v`'s runs."""
        return (self.seeds, self.steps) if v.full_size else CONTROL_SIZE

    def variants(self) -> Tuple[Variant, ...]:
        return REAL + (W4A8_REAL if self.w4a8 else ()) + (CONTROLS + PROBES if self.controls else ())


CONTROL_SIZE = (1, 2)  # (seeds, steps) of the controls whose check is structural

PRESETS = {
    "default": GrpoSettings(steps=6, seeds=5, prompts=16, group=8, prompt_len=4, response_len=3, lr=3e-3,
                            mini_batches=2, window=2),
    "quick": GrpoSettings(steps=4, seeds=4, prompts=16, group=8, prompt_len=4, response_len=3, lr=3e-3,
                          mini_batches=2, window=2, heldout_prompts=32, replay_rows=4),
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
    if getattr(args, "no_controls", False):
        changes["controls"] = False
    if getattr(args, "positive_control", False):
        changes["positive_control"] = True
    if getattr(args, "quick", False):
        changes["quick"] = True
    if getattr(args, "w4a8", False):
        changes["w4a8"] = True
    s = dataclasses.replace(s, **changes)
    if s.window * 2 > s.steps:
        s = dataclasses.replace(s, window=max(1, s.steps // 2))
    return s
