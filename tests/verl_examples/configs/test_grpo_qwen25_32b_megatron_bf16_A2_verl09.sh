#!/usr/bin/env bash
# bf16-rollout twin of test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh (A/B runs): the same launch
# with ROLLOUT_PRECISION=bf16.
# (verl 0.9.1 server mode, Megatron / MindSpeed engine).
#
# Usage: test_grpo_qwen25_32b_megatron_bf16_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets ROLLOUT_PRECISION bf16
exec bash "$HERE/test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh" "$@"
