#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with W4A8 rollouts through npu_flashrl on the current line (verl 0.9.1 server
# mode, vLLM / vllm-ascend 0.23.0): the rollout's projections run vllm-ascend's W4A8_DYNAMIC linear
# layers (int4 weights in groups of GROUP_SIZE input channels, two scale levels), quantized from the
# trainer's bf16 weights at every sync (docs/w4a8.md). The same flow and launch as
# grpo_qwen25_7b_fsdp_int8_A2_verl09.sh with FLASHRL_FN=w4a8_profile_free: `npu-flashrl setup --fn
# w4a8_profile_free -m MODEL_PATH` writes the config when it is missing (no profile, no W8A8
# checkpoint), then ../configs/test_grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh runs. Its bf16 twin (the
# same launch, bf16 rollout weights) is grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh.
# W4A8 on an NPU is not verified on hardware: docs/w4a8.md says what to run on a node first.
#
# Usage: grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen25_7b_fsdp_int8_A2_verl09.sh (FLASHRL_FN is fixed to w4a8_profile_free;
#   QUANT_MODEL_PATH and PROFILE_PATH are not read), plus
#   SETUP_EXTRA  extra key=value pairs for `npu-flashrl setup` [group_size=128: the group size must
#                divide every projection's input dim on each rollout TP rank, and o_proj / down_proj
#                hold in / ROLLOUT_TP of it; vllm-ascend's default 256 does not at ROLLOUT_TP=4]
#   EXPERIMENT_NAME [qwen25_7b_fsdp_w4a8_A2_verl09]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current
recipe_sets FLASHRL_FN w4a8_profile_free
export SETUP_EXTRA="${SETUP_EXTRA-group_size=128}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_7b_fsdp_w4a8_A2_verl09}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh}" "$@"
