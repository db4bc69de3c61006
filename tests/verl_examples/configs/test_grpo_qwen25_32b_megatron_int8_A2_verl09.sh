#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch with verl 0.9.1's Megatron / MindSpeed engine: Qwen2.5-32B on two
# Atlas 800T A2 nodes (16x 910B), INT8 rollout on vLLM-Ascend 0.23 through npu_flashrl. It is
# test_grpo_qwen25_7b_megatron_int8_A2.sh with RECIPE_LINE=current (../common.sh: server mode,
# decoupled token-level TIS, the server-mode preflight) and these sizes, after verl's own Ascend
# example for a 32B dense model on 16 NPUs (release/v0.9.0
# examples/ascend_extras/grpo_trainer/run_qwen3_32b_mindspeed.sh: train TP 4, PP 4, rollout TP 4):
#   * trainer TP 4 x PP 4 (DP 1), parameters and optimizer state offloaded to the host;
#   * rollout TP 4 (4 replicas);
#   * the weights reach the rollout through mbridge (vanilla_mbridge=True): verl's Ascend install
#     script installs mbridge, not Megatron-Bridge, and that export is what npu_flashrl verified on
#     CPU into the INT8 reload (docs/megatron.md).
# verl's Megatron engine on NPU is MindspeedEngineWithLMHead: MindSpeed (branch core_r0.16.0) and
# megatron-core (core_r0.16.0) must be installed (scripts/install_pinned.sh --line current).
#
# Normally started by ../flash_rl/grpo_qwen25_32b_megatron_int8_A2_verl09.sh, which prepares
# FLASHRL_CONFIG. Not run on hardware yet (docs/megatron.md "Only on hardware").
#
# Usage: test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_megatron_int8_A2.sh, with these defaults:
#   MODEL_PATH [$HOME/models/Qwen2.5-32B-Instruct]  NNODES [2]  NPUS_PER_NODE [8]
#   TRAIN_TP [4]  TRAIN_PP [4]  ROLLOUT_TP [4]  ACTOR_OFFLOAD [True]  REF_PARAM_OFFLOAD [True]
#   EXPERIMENT_NAME [qwen25_32b_megatron_${ROLLOUT_PRECISION}_A2_verl09]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current
export MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-32B-Instruct}"
export NNODES="${NNODES:-2}"
export NPUS_PER_NODE="${NPUS_PER_NODE:-8}"
export TRAIN_TP="${TRAIN_TP:-4}"
export TRAIN_PP="${TRAIN_PP:-4}"
export ROLLOUT_TP="${ROLLOUT_TP:-4}"
export ACTOR_OFFLOAD="${ACTOR_OFFLOAD:-True}"
export REF_PARAM_OFFLOAD="${REF_PARAM_OFFLOAD:-True}"
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_32b_megatron_${ROLLOUT_PRECISION:-int8}_A2_verl09}"
exec bash "$HERE/test_grpo_qwen25_7b_megatron_int8_A2.sh" "$@"
