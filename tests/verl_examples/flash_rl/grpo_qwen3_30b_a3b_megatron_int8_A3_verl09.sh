#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (MoE) with INT8 rollouts through npu_flashrl on the current line (verl 0.9.1
# server mode, vLLM / vllm-ascend 0.23.0), verl 0.9.1's Megatron / MindSpeed trainer engine with
# expert parallelism, one Atlas 800T A3 node (16 NPUs). The same flow as
# grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh, then
# ../configs/test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh (sizes listed there).
# FLASHRL_FN defaults to int8_profile_free: FlashRL's `int8` profile does not cover MoE experts and
# is refused. Walkthrough: docs/megatron.md, docs/moe.md (not verified on hardware yet).
#
# Usage: grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh, except the Megatron / rollout settings of
#   ../configs/test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh
#   (NPUS_PER_NODE [16] TRAIN_TP [4] TRAIN_EP [4] TRAIN_ETP [4] ROLLOUT_TP [4] ROLLOUT_EP [TP x DP] ...)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current; recipe_sets RECIPE_MOE 1  # MoE: FlashRL's int8 profile fns are refused (npu-flashrl preflight)
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}"
export FLASHRL_FN="${FLASHRL_FN:-int8_profile_free}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_30b_a3b_megatron_${FLASHRL_FN}_A3_verl09}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh}" "$@"
