#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch: Qwen2.5-32B, Megatron / MindSpeed trainer, vLLM-Ascend 0.23
# rollout with W4A8 weights (vllm-ascend's W4A8_DYNAMIC linear layers) through npu_flashrl, two
# Atlas 800T A2 nodes. test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh with ROLLOUT_PRECISION=w4a8:
# the same launch; the preflight holds FLASHRL_CONFIG to it (its entries must be fn: w4a8_profile_free).
#
# Normally started by ../flash_rl/grpo_qwen25_32b_megatron_w4a8_A2_verl09.sh, which prepares FLASHRL_CONFIG.
#
# Usage: test_grpo_qwen25_32b_megatron_w4a8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh (ROLLOUT_PRECISION is fixed to w4a8).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets ROLLOUT_PRECISION w4a8
exec bash "$HERE/test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh" "$@"
