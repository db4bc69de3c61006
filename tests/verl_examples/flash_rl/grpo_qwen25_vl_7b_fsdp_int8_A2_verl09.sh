#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-7B (images + text, Geometry3K) with INT8 rollouts through npu_flashrl on the
# current line (verl 0.9.1 server mode, vLLM / vllm-ascend 0.23.0), FSDP trainer, one Atlas 800T A2
# node: the language model's projections W8A8_DYNAMIC, the vision tower and merger 16-bit
# (docs/compatibility.md, Qwen2.5-VL). The flow of grpo_qwen25_7b_fsdp_int8_A2_verl09.sh with
# ../configs/test_grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh. Data: DATASET=geo3k bash
# ../data/prepare_data.sh.
#
# Usage: grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, with these defaults:
#   MODEL_PATH  [$HOME/models/Qwen2.5-VL-7B-Instruct]
#   FLASHRL_FN  [int8_profile_free] (FlashRL's profile-based `int8` is not tested on VL checkpoints)
#   DATASET     [geo3k]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-VL-7B-Instruct}"
export FLASHRL_FN="${FLASHRL_FN:-int8_profile_free}"
export DATASET="${DATASET:-geo3k}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_vl_7b_fsdp_${FLASHRL_FN}_A2_verl09}"
export CONFIG_SCRIPT="${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh}"
exec bash "$HERE/grpo_qwen25_7b_fsdp_int8_A2_verl09.sh" "$@"
