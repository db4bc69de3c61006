#!/usr/bin/env bash
# The bf16 rollout / one_step_off twin of test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh: the same launch with
# ROLLOUT_PRECISION=bf16 and ASYNC_MODE=one_step_off (docs/scale_out.md).
#
# Usage: test_grpo_qwen25_7b_fsdp_bf16_A2_one_step_off.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets ROLLOUT_PRECISION bf16
recipe_sets ASYNC_MODE one_step_off
exec bash "$HERE/test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh" "$@"
