#!/usr/bin/env bash
# The bf16 twin of test_grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh: the same Qwen2.5-VL-7B GRPO launch
# on Geometry3K, identical except the rollout quantization (test_grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh
# with the VL settings listed there).
#
# Usage: test_grpo_qwen25_vl_7b_fsdp_bf16_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
export ROLLOUT_PRECISION="${ROLLOUT_PRECISION:-bf16}"
export VL_BASE_SCRIPT="$HERE/test_grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh"
exec bash "$HERE/test_grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh" "$@"
