#!/usr/bin/env bash
# bf16 baseline for A/B runs against grpo_qwen25_7b_fsdp_int8_A2.sh: the same verl launch
# (../configs/test_grpo_qwen25_7b_fsdp_bf16_A2.sh runs the int8 config script with
# ROLLOUT_PRECISION=bf16), the same FP32 lm-head and logging through an npu_flashrl `--fn bf16`
# config; only the rollout weights stay bf16. With BASELINE_NPU_FLASHRL=0 npu_flashrl is not
# activated at all (plain verl; then the lm-head is not FP32 either, so it is no longer a pure A/B).
#
# Usage: grpo_qwen25_7b_fsdp_bf16_A2.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_7b_fsdp_int8_A2.sh (FLASHRL_FN is fixed to bf16), plus
#   BASELINE_NPU_FLASHRL  True | False (also 1/0) [True]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_7b_fsdp_bf16_A2}"
CONFIG_SCRIPT="${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_7b_fsdp_bf16_A2.sh}"
flashrl_baseline_entry "$CONFIG_SCRIPT" "$@"  # FLASHRL_FN=bf16; BASELINE_NPU_FLASHRL=False: plain verl
