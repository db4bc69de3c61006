#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with INT8 rollouts through npu_flashrl and verl's Megatron trainer backend with
# MindSpeed, one Atlas 800T A2 node. Same flow as grpo_qwen25_7b_fsdp_int8_A2.sh: prepares the
# profile and config with `npu-flashrl profile/setup` when missing, checks every input, then runs
# ../configs/test_grpo_qwen25_7b_megatron_int8_A2.sh (Megatron settings are listed there).
#
# Usage: grpo_qwen25_7b_megatron_int8_A2.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_7b_fsdp_int8_A2.sh (MODEL_PATH, FLASHRL_FN, QUANT_MODEL_PATH, RUN_DIR,
# PROFILE_PATH, FLASHRL_CONFIG, SETUP_EXTRA, NPU_FLASHRL_CLI, DATASET, DATA_DIR, TRAIN_FILE, VAL_FILE,
# NNODES, NPUS_PER_NODE, RAY_ADDRESS) plus TRAIN_TP, TRAIN_PP, TRAIN_CP, ACTOR_OFFLOAD, USE_DIST_CKPT,
# DIST_CKPT_PATH, USE_MBRIDGE, USE_FLASH_ATTN, RECOMPUTE_* of the config script.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_7b_megatron_${FLASHRL_FN:-int8}_A2}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_7b_megatron_int8_A2.sh}" "$@"
