#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch for a MoE model: Qwen3-30B-A3B (48 layers, 128 experts, top-8),
# FSDP trainer, vLLM-Ascend 0.23 rollout with INT8 experts and attention through npu_flashrl, on one
# Atlas 800T A3 node (16 NPUs). It is test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh (the same GRPO,
# TIS, server-mode sync and preflight; ../common.sh with RECIPE_LINE=current) with these MoE
# settings:
#   * rollout parallelism: TP 4 per replica (4 replicas on 16 NPUs), expert parallel on
#     (actor_rollout_ref.rollout.expert_parallel_size = TP x DP: verl 0.9.1 passes vLLM
#     enable_expert_parallel=True for EP > 1, and its RolloutConfig requires EP = TP x DP);
#     ROLLOUT_EP=1 instead splits every expert over the TP ranks (vLLM's expert-TP);
#   * FSDP actor: parameters and optimizer state offloaded to the host (about 30 GB per NPU of
#     fp32 weights, gradients and Adam state over 16 NPUs, next to the colocated rollout);
#   * refused here, before anything starts, because npu_flashrl's in-place INT8 expert reload
#     refuses them at engine build (docs/moe.md): vllm-ascend's dynamic EPLB
#     (additional_config eplb_config.dynamic_eplb / expert_map_path) and redundant experts
#     (num_redundant_experts > 0), vLLM's enable_eplb; a FLASHRL_CONFIG with `fn: int8` (FlashRL's
#     profile has no expert entries: use int8_profile_free, or a compressed-tensors / ModelSlim
#     W8A8_DYNAMIC MoE checkpoint).
# The trainer sends fp32 per-expert tensors (verl's unfuse_moe_params on transformers 5's packed
# experts) in UPDATE_WEIGHTS_BUCKET_MB buckets; npu_flashrl stages at most one layer's experts in
# INT8 per layer being received (TP 4 / EP 4: about 144 MiB) and writes them in place.
#
# Normally started by ../flash_rl/grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh, which prepares
# FLASHRL_CONFIG. Not run on hardware yet: docs/moe.md "Not verified on hardware".
#
# Usage: test_grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, with these
# defaults changed or added:
#   MODEL_PATH               [$HOME/models/Qwen3-30B-A3B]
#   NPUS_PER_NODE [16]  ROLLOUT_TP [4]  ROLLOUT_DP [1]  ROLLOUT_EP [ROLLOUT_TP x ROLLOUT_DP; or 1]
#   ACTOR_PARAM_OFFLOAD [True]  ACTOR_OPTIMIZER_OFFLOAD [True]
#   EXPERIMENT_NAME          [qwen3_30b_a3b_fsdp_${ROLLOUT_PRECISION}_A3_verl09]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
parse_recipe_args "$@"  # unknown options refused first
recipe_sets RECIPE_LINE current; recipe_sets RECIPE_MOE 1

export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}"
export NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
export ROLLOUT_TP="${ROLLOUT_TP:-4}"
export ROLLOUT_DP="${ROLLOUT_DP:-1}"
FEATURES=fsdp
recipe_line
recipe_vars  # before the arithmetic below
export ROLLOUT_EP="${ROLLOUT_EP:-$((ROLLOUT_TP * ROLLOUT_DP))}"
export ACTOR_PARAM_OFFLOAD="${ACTOR_PARAM_OFFLOAD:-True}"
export ACTOR_OPTIMIZER_OFFLOAD="${ACTOR_OPTIMIZER_OFFLOAD:-True}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_30b_a3b_fsdp_${ROLLOUT_PRECISION:-int8}_A3_verl09}"

MOE_OVERRIDES=(
  "actor_rollout_ref.rollout.data_parallel_size=$ROLLOUT_DP"
  "actor_rollout_ref.rollout.expert_parallel_size=$ROLLOUT_EP"
)
exec bash "$HERE/test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh" "${MOE_OVERRIDES[@]}" "$@"
