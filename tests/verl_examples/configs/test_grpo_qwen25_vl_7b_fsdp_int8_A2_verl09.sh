#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch of a vision-language model: Qwen2.5-VL-7B on Geometry3K
# (images + questions, verl's examples/data_preprocess/geo3k.py through ../data/prepare_data.sh with
# DATASET=geo3k), FSDP trainer, vLLM-Ascend 0.23 rollout with the language model's projections
# INT8 through npu_flashrl (the vision tower and merger stay 16-bit), one Atlas 800T A2 node.
# The Qwen2.5-7B current-line launch (test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh) with what verl's
# own Qwen2.5-VL GRPO example (examples/grpo_trainer/run_qwen2_5_vl_7b_npu.sh) sets differently:
#   * data.image_key=images (the geo3k parquet's image column);
#   * MAX_PROMPT_LENGTH [1024] / MAX_RESPONSE_LENGTH [2048] (the example's lengths);
#   * MODEL_PATH [$HOME/models/Qwen2.5-VL-7B-Instruct], DATASET [geo3k].
#
# Normally started by ../flash_rl/grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh.
#
# Usage: test_grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, with the defaults
# above and EXPERIMENT_NAME [qwen25_vl_7b_fsdp_${ROLLOUT_PRECISION}_A2_verl09].
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-VL-7B-Instruct}"
export DATASET="${DATASET:-geo3k}"
export MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-1024}"
export MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-2048}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_vl_7b_fsdp_${ROLLOUT_PRECISION:-int8}_A2_verl09}"
exec bash "${VL_BASE_SCRIPT:-$HERE/test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh}" data.image_key=images "$@"
