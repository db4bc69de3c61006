#!/usr/bin/env bash
# GRPO on Qwen2.5-32B with W4A8 rollouts through npu_flashrl on the current line (verl 0.9.1 server
# mode, vLLM / vllm-ascend 0.23.0), verl 0.9.1's Megatron / MindSpeed trainer engine, two Atlas 800T
# A2 nodes: grpo_qwen25_32b_megatron_int8_A2_verl09.sh with FLASHRL_FN=w4a8_profile_free (vllm-ascend's
# W4A8_DYNAMIC linear layers, quantized from the trainer's bf16 weights at every sync; docs/w4a8.md):
# `npu-flashrl setup --fn w4a8_profile_free -m MODEL_PATH` writes the config when it is missing, then
# ../configs/test_grpo_qwen25_32b_megatron_w4a8_A2_verl09.sh runs. Its bf16 twin is
# grpo_qwen25_32b_megatron_bf16_A2_verl09.sh. Not verified on hardware (docs/w4a8.md).
#
# Usage: grpo_qwen25_32b_megatron_w4a8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_32b_megatron_int8_A2_verl09.sh (FLASHRL_FN is fixed to w4a8_profile_free;
#   QUANT_MODEL_PATH and PROFILE_PATH are not read), plus
#   SETUP_EXTRA      extra key=value pairs for `npu-flashrl setup`, e.g. group_size=128 [empty: group
#                    size 256, vllm-ascend's default; it must divide every projection's input dim on
#                    each rollout TP rank, o_proj / down_proj holding in / ROLLOUT_TP of it]
#   EXPERIMENT_NAME  [qwen25_32b_megatron_w4a8_A2_verl09]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets FLASHRL_FN w4a8_profile_free
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_32b_megatron_w4a8_A2_verl09}"
export CONFIG_SCRIPT="${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_32b_megatron_w4a8_A2_verl09.sh}"
exec bash "$HERE/grpo_qwen25_32b_megatron_int8_A2_verl09.sh" "$@"
