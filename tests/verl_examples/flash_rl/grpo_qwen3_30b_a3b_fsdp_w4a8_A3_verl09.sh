#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (MoE) with W4A8 rollouts through npu_flashrl on the current line (verl 0.9.1
# server mode, vLLM / vllm-ascend 0.23.0), FSDP trainer, one Atlas 800T A3 node (16 NPUs):
# grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh with FLASHRL_FN=w4a8_profile_free. The rollout's experts
# run vllm-ascend's W4A8_DYNAMIC fused-MoE layers and its other projections its W4A8_DYNAMIC linear
# layers, quantized from the bf16 checkpoint at load and from the trainer's bf16 weights at every
# sync (docs/w4a8.md, Fused MoE). `npu-flashrl setup --fn w4a8_profile_free -m MODEL_PATH` writes
# the config when it is missing, then ../configs/test_grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh
# runs. Its bf16 twin is grpo_qwen3_30b_a3b_fsdp_bf16_A3_verl09.sh. Not verified on hardware
# (docs/w4a8.md).
#
# Usage: grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: as grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh (FLASHRL_FN is fixed to w4a8_profile_free;
#   QUANT_MODEL_PATH and PROFILE_PATH are not read), plus
#   SETUP_EXTRA      extra key=value pairs for `npu-flashrl setup` [empty: group size 256, the only
#                    one of the A8W4 grouped matmul the experts run; it must divide every per-rank
#                    input dim: o_proj's in / ROLLOUT_TP, the experts' moe_intermediate_size whole
#                    with expert parallel on (ROLLOUT_EP > 1), / ROLLOUT_TP with it off; group_size=0
#                    (per-channel) needs a ModelSlim checkpoint and is refused for a bf16 MODEL_PATH]
#   EXPERIMENT_NAME  [qwen3_30b_a3b_fsdp_w4a8_A3_verl09]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current; recipe_sets RECIPE_MOE 1  # MoE: the preflight checks the group size against the experts' split
recipe_sets FLASHRL_FN w4a8_profile_free
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_30b_a3b_fsdp_w4a8_A3_verl09}"
flashrl_entry "${CONFIG_SCRIPT:-$HERE/../configs/test_grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh}" "$@"
