#!/usr/bin/env bash
# bf16 baseline for A/B runs against grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh (verl 0.9.1 server
# mode, Qwen3-30B-A3B MoE): grpo_qwen25_7b_fsdp_bf16_A2.sh with RECIPE_LINE=current and
# ../configs/test_grpo_qwen3_30b_a3b_fsdp_bf16_A3_verl09.sh, so the same launch, FP32 lm-head and
# logging through an npu_flashrl `--fn bf16` config; only the rollout weights stay bf16. With
# BASELINE_NPU_FLASHRL=0 npu_flashrl is not activated at all (plain verl).
#
# Usage: grpo_qwen3_30b_a3b_fsdp_bf16_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh (FLASHRL_FN is fixed to bf16), plus
#   BASELINE_NPU_FLASHRL  True | False (also 1/0) [True]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_30b_a3b_fsdp_bf16_A3_verl09}"
export CONFIG_SCRIPT="${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen3_30b_a3b_fsdp_bf16_A3_verl09.sh}"
exec bash "$HERE/grpo_qwen25_7b_fsdp_bf16_A2.sh" "$@"
