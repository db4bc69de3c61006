#!/usr/bin/env bash
# GRPO on Qwen2.5-32B with INT8 rollouts through npu_flashrl on the current line (verl 0.9.1 server
# mode, vLLM / vllm-ascend 0.23.0), verl 0.9.1's Megatron / MindSpeed trainer engine, two Atlas 800T
# A2 nodes (16 NPUs). The same flow as grpo_qwen25_7b_fsdp_int8_A2_verl09.sh: prepares the
# FlashRL-format profile and config with `npu-flashrl profile/setup` when they are missing, checks
# every input, then runs ../configs/test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh (sizes, bridge
# and MindSpeed are listed there). Walkthrough: docs/megatron.md (not verified on hardware yet).
#
# Usage: grpo_qwen25_32b_megatron_int8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, except
#   MODEL_PATH   bf16 HF checkpoint of the actor [$HOME/models/Qwen2.5-32B-Instruct]
#   the Megatron / rollout settings of ../configs/test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh
#   (NNODES [2] NPUS_PER_NODE [8] TRAIN_TP [4] TRAIN_PP [4] ROLLOUT_TP [4] ...)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-32B-Instruct}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_32b_megatron_${FLASHRL_FN:-int8}_A2_verl09}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh}" "$@"
