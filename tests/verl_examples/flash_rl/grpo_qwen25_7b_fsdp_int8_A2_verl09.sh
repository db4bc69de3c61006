#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with INT8 rollouts through npu_flashrl on the current line (verl 0.9.1 server
# mode, vLLM / vllm-ascend 0.23.0), FSDP trainer, one Atlas 800T A2 node. The same flow as the pinned
# grpo_qwen25_7b_fsdp_int8_A2.sh: prepares the FlashRL-format profile and config with
# `npu-flashrl profile/setup` when they are missing, checks every input, then runs
# ../configs/test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh (the verl 0.9 differences are listed there).
# Walkthrough: docs/quickstart_current.md.
#
# Usage: grpo_qwen25_7b_fsdp_int8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment (defaults in brackets; the verl settings are listed in the config scripts):
#   MODEL_PATH        bf16 HF checkpoint of the actor [$HOME/models/Qwen2.5-7B-Instruct]
#   FLASHRL_FN        int8 | int8_profile_free [int8]
#   QUANT_MODEL_PATH  W8A8 checkpoint for the profile and int8 config [${MODEL_PATH}-W8A8]
#   RUN_DIR           where profile and config are written [$HOME/npu_flashrl_runs]
#   PROFILE_PATH      [$RUN_DIR/profiles/<model>.int8_profile.pt]
#   FLASHRL_CONFIG    [$RUN_DIR/configs/<model>.$FLASHRL_FN.yaml]
#   SETUP_EXTRA       extra key=value pairs for `npu-flashrl setup` [empty]
#   NPU_FLASHRL_CLI   [npu-flashrl]
#   DATASET [gsm8k] DATA_DIR [$HOME/data/$DATASET] TRAIN_FILE / VAL_FILE [$DATA_DIR/{train,test}.parquet]
#   NNODES [1] NPUS_PER_NODE [8] RAY_ADDRESS [empty = local Ray]; see docs/quickstart_a2.md (multi-node)
#   UPDATE_WEIGHTS_BUCKET_MB [2048]  TIS_LEVEL [token]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_sets RECIPE_LINE current
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_7b_fsdp_${FLASHRL_FN:-int8}_A2_verl09}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh}" "$@"
