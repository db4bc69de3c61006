#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with INT8 rollouts through npu_flashrl on the current line, the rollout on NPUs
# of its own (verl 0.9.1's one_step_off trainer, weights synced by its checkpoint engine; docs/scale_out.md).
# The same flow as grpo_qwen25_7b_fsdp_int8_A2_verl09.sh: prepares the FlashRL-format profile and
# config with `npu-flashrl profile/setup` when they are missing, checks every input, then runs
# ../configs/test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh (pool sizes and checkpoint engine are listed
# there). The INT8 wire (half the HCCL bytes) is SETUP_EXTRA=wire=int8 (`wire: int8` in the config).
#
# Usage: grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, plus the pool settings of
#   ../configs/test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh (TRAINER_NPUS [4] ROLLOUT_NPUS [4]
#   ROLLOUT_NNODES [1] CHECKPOINT_ENGINE [nccl] ...)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_sets RECIPE_LINE current
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh}" "$@"
