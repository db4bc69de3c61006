#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (MoE) with W4A8 rollouts through npu_flashrl on the current line (verl 0.9.1
# server mode, vLLM / vllm-ascend 0.23.0), verl 0.9.1's Megatron / MindSpeed trainer engine with
# expert parallelism, one Atlas 800T A3 node (16 NPUs): grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh
# with FLASHRL_FN=w4a8_profile_free (W4A8_DYNAMIC fused-MoE experts and linear layers, quantized from
# the bf16 checkpoint at load and from the trainer's weights at every sync; docs/w4a8.md, Fused MoE).
# `npu-flashrl setup --fn w4a8_profile_free -m MODEL_PATH` writes the config when it is missing, then
# ../configs/test_grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh runs. Its bf16 twin is
# grpo_qwen3_30b_a3b_megatron_bf16_A3_verl09.sh. Not verified on hardware (docs/w4a8.md).
#
# Usage: grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh (FLASHRL_FN is fixed to
#   w4a8_profile_free; QUANT_MODEL_PATH and PROFILE_PATH are not read), plus SETUP_EXTRA and
#   EXPERIMENT_NAME [qwen3_30b_a3b_megatron_w4a8_A3_verl09] as in grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current; recipe_sets RECIPE_MOE 1  # MoE: the preflight checks the group size against the experts' split
recipe_sets FLASHRL_FN w4a8_profile_free
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_30b_a3b_megatron_w4a8_A3_verl09}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh}" "$@"
