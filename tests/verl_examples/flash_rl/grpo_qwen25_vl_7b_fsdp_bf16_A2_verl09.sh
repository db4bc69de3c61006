#!/usr/bin/env bash
# bf16 baseline for A/B runs against grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh: the same Qwen2.5-VL-7B
# GRPO on Geometry3K (grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh with
# ../configs/test_grpo_qwen25_vl_7b_fsdp_bf16_A2_verl09.sh); only the rollout weights stay bf16.
#
# Usage: grpo_qwen25_vl_7b_fsdp_bf16_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh (FLASHRL_FN is fixed to bf16), plus
#   BASELINE_NPU_FLASHRL  1 | 0 [1]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-VL-7B-Instruct}"
export DATASET="${DATASET:-geo3k}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_vl_7b_fsdp_bf16_A2_verl09}"
export CONFIG_SCRIPT="${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_vl_7b_fsdp_bf16_A2_verl09.sh}"
exec bash "$HERE/grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh" "$@"
