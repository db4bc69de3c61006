"""`npu-flashrl rehearse --grpo`: "INT8 rollout + TIS trains like bf16", end to end on the tiny model,
with verl's own GRPO code.

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
   `int8+tis+fp32head`; `--seeds K` runs of each; the same prompts (and sampling stream) per
   (seed, step) in every variant.
5. **Verdict** (`checks.py`) and **output** (`report.py`): the per-step table, report.json
   (`grpo.variants.<name>.reward` / `.reward_std` per step, the bounds), grpo.png.

Sizes: `settings.PRESETS` (default <= 3 min, `--quick` < 60 s on 2 CPU cores, tiny model cached).
Lines: the verl of every stack line (`npu_flashrl.lines`) has these functions with the same names
and arguments; the run is verified on the current line and the primary line (server-mode verl with its
bucketed transfer, sync-mode verl with in-process `load_weights`), not yet on the pinned line.
"""
from __future__ import annotations

from npu_flashrl.rehearsal.grpo.run import run  # noqa: F401
