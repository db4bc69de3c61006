#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch for a MoE model with the Megatron engine and W4A8 rollouts: exactly
# test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh with ROLLOUT_PRECISION=w4a8 (the same trainer
# TP / EP / ETP, rollout TP / EP, GRPO, TIS, EPLB refusals); the preflight holds FLASHRL_CONFIG to it
# (its entries must be fn: w4a8_profile_free) and its group size to the experts' split at this
# launch's ROLLOUT_TP / ROLLOUT_EP (npu_flashrl/recipes/w4a8_groups.py).
#
# Normally started by ../flash_rl/grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh, which prepares FLASHRL_CONFIG.
#
# Usage: test_grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh (ROLLOUT_PRECISION is fixed to w4a8).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets ROLLOUT_PRECISION w4a8
exec bash "$HERE/test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh" "$@"
