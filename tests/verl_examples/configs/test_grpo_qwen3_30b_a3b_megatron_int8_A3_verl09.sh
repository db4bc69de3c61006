#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch for a MoE model with verl 0.9.1's Megatron / MindSpeed engine:
# Qwen3-30B-A3B (48 layers, 128 experts, top-8) on one Atlas 800T A3 node (16 NPUs), INT8 rollout
# (attention and experts) on vLLM-Ascend 0.23 through npu_flashrl. It is
# test_grpo_qwen25_7b_megatron_int8_A2.sh with RECIPE_LINE=current and these sizes, after verl's own
# Ascend example for this model (release/v0.9.0
# examples/ascend_extras/grpo_trainer/run_qwen3_30b_a3b_megatron.sh: train TP 4, EP 4, ETP 4, PP 1,
# everything offloaded, rollout TP 4):
#   * trainer TP 4, expert parallel 4 (ETP 4), PP 1; parameters and optimizer state offloaded;
#   * rollout TP 4 per replica with expert parallel (EP = TP x DP), as
#     test_grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh; the same MoE checks (npu-flashrl preflight, from
#     ../common.sh: dynamic EPLB, redundant experts and `fn: int8` refused for INT8 rollouts);
#   * weights to the rollout through mbridge (vanilla_mbridge=True): per-expert HF names, EP
#     all-gathered by the bridge (docs/megatron.md).
# MindSpeed (core_r0.16.0) and megatron-core (core_r0.16.0) must be installed
# (scripts/install_pinned.sh --line current).
#
# Normally started by ../flash_rl/grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh, which prepares
# FLASHRL_CONFIG. Not run on hardware yet (docs/megatron.md "Only on hardware").
#
# Usage: test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_megatron_int8_A2.sh, with these defaults:
#   MODEL_PATH [$HOME/models/Qwen3-30B-A3B]  NPUS_PER_NODE [16]
#   TRAIN_TP [4]  TRAIN_PP [1]  TRAIN_EP [4]  TRAIN_ETP [4]  ACTOR_OFFLOAD [True]
#   ROLLOUT_TP [4]  ROLLOUT_DP [1]  ROLLOUT_EP [ROLLOUT_TP x ROLLOUT_DP; or 1]
#   EXPERIMENT_NAME [qwen3_30b_a3b_megatron_${ROLLOUT_PRECISION}_A3_verl09]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
parse_recipe_args "$@"  # unknown options refused first
recipe_sets RECIPE_LINE current; recipe_sets RECIPE_MOE 1

export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen3-30B-A3B}"
export NPUS_PER_NODE="${NPUS_PER_NODE:-16}"
export TRAIN_TP="${TRAIN_TP:-4}"
export TRAIN_PP="${TRAIN_PP:-1}"
export TRAIN_EP="${TRAIN_EP:-4}"
export TRAIN_ETP="${TRAIN_ETP:-4}"
export ACTOR_OFFLOAD="${ACTOR_OFFLOAD:-True}"
export ROLLOUT_TP="${ROLLOUT_TP:-4}"
export ROLLOUT_DP="${ROLLOUT_DP:-1}"
FEATURES=megatron
recipe_line
recipe_vars  # before the arithmetic below
export ROLLOUT_EP="${ROLLOUT_EP:-$((ROLLOUT_TP * ROLLOUT_DP))}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen3_30b_a3b_megatron_${ROLLOUT_PRECISION:-int8}_A3_verl09}"

MOE_OVERRIDES=(
  "actor_rollout_ref.rollout.data_parallel_size=$ROLLOUT_DP"
  "actor_rollout_ref.rollout.expert_parallel_size=$ROLLOUT_EP"
)
exec bash "$HERE/test_grpo_qwen25_7b_megatron_int8_A2.sh" "${MOE_OVERRIDES[@]}" "$@"
