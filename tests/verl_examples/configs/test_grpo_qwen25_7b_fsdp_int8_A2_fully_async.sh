#!/usr/bin/env bash
# The int8 rollout / fully_async twin of test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh: the same launch with
# ROLLOUT_PRECISION=int8 and ASYNC_MODE=fully_async (docs/scale_out.md).
#
# Usage: test_grpo_qwen25_7b_fsdp_int8_A2_fully_async.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets ROLLOUT_PRECISION int8
recipe_sets ASYNC_MODE fully_async
exec bash "$HERE/test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh" "$@"
