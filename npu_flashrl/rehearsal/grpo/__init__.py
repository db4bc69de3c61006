"""`npu-flashrl rehearse --grpo`: "INT8 rollout + TIS trains like bf16", end to end on the tiny model,
with verl's own GRPO code, as an experiment with controls.

What one run does:

1. **Model and setup** as the default rehearsal: the cached pre-trained tiny Qwen2, `npu-flashrl
   setup`, `npu_flashrl.activate`, rollout models built through the real vLLM + vllm-ascend code.
2. **Task** (`task.py`): continue a chain of the synthetic task along its most likely successors;
   reward 1 for an exact answer, else 0. The pre-trained model gets about a third right.
3. **GRPO** (`loop.py`) per variant and seed: sample `group` responses per prompt from the rollout
   model at temperature 1 (`sampling.py`, rollout log-probs as vLLM returns them), reward,
   verl's `compute_grpo_outcome_advantage`, the trainer's `old_log_prob`, verl's rollout
   correction (`compute_rollout_correction_and_add_to_batch`, token-level TIS at 2.0 from
   npu_flashrl's `tis_overrides`), verl's vanilla policy loss (`get_policy_loss_fn("vanilla")`,
   `agg_loss`) per mini-batch and AdamW on the fp32 masters (`trainer.py`), then the bf16 weights
   pushed through the line's transport and, for INT8, the INT8 state checked after every sync.
   verl's functions are called from verl's modules (`verl_algo.py`), never copied.
4. **Variants** (`settings.py`): `bf16` (the reference), `int8` (no TIS), `int8+tis`,
   `int8+tis+fp32head`; `--seeds K` runs of each (default 5); the same prompts (and sampling
   stream) per (seed, step) in every variant. **Negative controls** (`settings.CONTROLS`, named
   switches of the loop): inverted TIS ratio, TIS weights forced to 1, rollout log-probs from the
   trainer, stale rollout weights, int8+tis at a quarter of the learning rate; each must fail the
   check it names, or the run fails. A **power probe** (int8+tis at 0.75x the learning rate) must be
   caught or have an effect within the detectable difference printed for the tracked variants.
5. **Held-out score** (`heldout.py`): each run's trained policy (the trainer's weights) scored on
   prompts no run trained on, as the exact probability of the right answer.
6. **Verdict** (`checks.py`, `stats.py`) and **output** (`report.py`): paired per-seed differences
   from bf16 of the held-out score (the verdict) and over the whole curve (secondary), with t
   intervals and the smallest detectable difference (noncentral t, with the SE under an effect: the
   larger of the comparison's own and the slow learner's / power probe's); the per-step table, report.json (`grpo.variants.<name>.reward` per step,
   `.heldout`, `grpo.paired`, `grpo.controls`, `grpo.positive_control`), grpo.png (curves with 95%
   intervals).
7. **Positive control** (`--positive-control`, `positive.py`): the settings of its table, where the
   rollout departs from the trainer enough that int8 without TIS should train worse (and one where
   TIS should hurt), run in the same run; reported, not checked: what they show is stated from their
   intervals.

Sizes: `settings.PRESETS` (default within 5 min of CPU time, `--quick` about 2 min, on 2 CPU cores
with the tiny model cached). Phases of one run: `run.py`.
Lines: the verl of every stack line (`npu_flashrl.lines`) has these functions with the same names
and arguments; the run is verified on the current line and the primary line (server-mode verl with its
bucketed transfer, sync-mode verl with in-process `load_weights`), not yet on the pinned line.
"""
from __future__ import annotations

from npu_flashrl.rehearsal.grpo.run import run  # noqa: F401
