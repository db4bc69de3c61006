#!/usr/bin/env bash
# verl 0.9.1 GRPO with the rollout on its own NPUs: Qwen2.5-7B, FSDP trainer, vLLM-Ascend 0.23 rollout
# with INT8 weights through npu_flashrl, one Atlas 800T A2 node (8x 910B) split into a trainer pool and
# a rollout pool, weights synced over HCCL by verl's checkpoint engine
# (actor_rollout_ref.rollout.checkpoint_engine.backend=nccl: HCCLCheckpointEngine on Ascend).
# ASYNC_MODE picks verl's experimental trainer:
#   one_step_off  verl.experimental.one_step_off_policy.main_ppo (one step of staleness)
#   fully_async   verl.experimental.fully_async_policy.fully_async_main (partial rollout: in-flight
#                 requests are aborted at a sync and resumed on the new weights)
# Everything else is the current-line launch of test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh.
# The INT8 wire (trainer-side quantization, half the HCCL bytes) is `wire: int8` in FLASHRL_CONFIG:
#   npu-flashrl setup -m "$MODEL_PATH" --fn int8_profile_free -o "$FLASHRL_CONFIG" wire=int8
# See docs/scale_out.md.
#
# Usage: test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, plus
#   ASYNC_MODE      one_step_off | fully_async [one_step_off]
#   TRAINER_NPUS    NPUs per node of the trainer pool [4]
#   ROLLOUT_NPUS    NPUs per node of the rollout pool [4]; ROLLOUT_TP divides it
#   NPUS_PER_NODE   NPUs of one node [8]: each pool fits in it; pools that do not fit one node
#                   together (or ROLLOUT_NNODES > 1) need a Ray cluster (RAY_ADDRESS)
#   ROLLOUT_NNODES  nodes of the rollout pool [1]
#   CHECKPOINT_ENGINE  checkpoint_engine.backend [nccl]: a name of verl 0.9.1's CheckpointEngineRegistry
#                   (naive, nccl = HCCL on Ascend, nixl, ...); delta_sharded is refused with an INT8 FLASHRL_CONFIG
#   TRIGGER_SYNC_STEPS  fully_async: async_training.trigger_parameter_sync_step [4]
#   STALENESS       fully_async: async_training.staleness_threshold [0.1]
#   TOTAL_ROLLOUT_STEPS  fully_async: rollout.total_rollout_steps [100]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current
parse_recipe_args "$@"

ASYNC_MODE="${ASYNC_MODE:-one_step_off}"
FEATURES=fsdp,async  # every variable is checked in grpo_defaults, before the launch
if [[ "$ASYNC_MODE" == fully_async ]]; then FEATURES+=",fully_async"; fi  # its own variables (STALENESS, ...)
TRAINER_NPUS="${TRAINER_NPUS:-4}"
ROLLOUT_NPUS="${ROLLOUT_NPUS:-4}"
ROLLOUT_NNODES="${ROLLOUT_NNODES:-1}"
CHECKPOINT_ENGINE="${CHECKPOINT_ENGINE:-nccl}"
TRIGGER_SYNC_STEPS="${TRIGGER_SYNC_STEPS:-4}"
STALENESS="${STALENESS:-0.1}"
TOTAL_ROLLOUT_STEPS="${TOTAL_ROLLOUT_STEPS:-100}"
PREFLIGHT_ARGS=(--node-npus "${NPUS_PER_NODE:-8}")  # the node's size: each pool's NPUs per node fit in it
if [[ "$ASYNC_MODE" == fully_async ]]; then
  ENTRY=verl.experimental.fully_async_policy.fully_async_main
else
  ENTRY=verl.experimental.one_step_off_policy.main_ppo
fi

# the trainer pool is trainer.n_gpus_per_node (NPUS_PER_NODE of the shared overrides)
export NPUS_PER_NODE="$TRAINER_NPUS"
grpo_defaults "qwen25_7b_fsdp_${ASYNC_MODE}"
grpo_inputs
grpo_worker_env
grpo_shared_overrides

ASYNC_OVERRIDES=(
  "rollout.nnodes=$ROLLOUT_NNODES"
  "rollout.n_gpus_per_node=$ROLLOUT_NPUS"
  "actor_rollout_ref.rollout.checkpoint_engine.backend=$CHECKPOINT_ENGINE"
)
if [[ "$ASYNC_MODE" == fully_async ]]; then
  ASYNC_OVERRIDES+=(
    "async_training.trigger_parameter_sync_step=$TRIGGER_SYNC_STEPS"
    "async_training.staleness_threshold=$STALENESS"
    async_training.partial_rollout=True
    "rollout.total_rollout_steps=$TOTAL_ROLLOUT_STEPS"
  )
fi

CMD=(
  env "${WORKER_ENV[@]}"
  "$PYTHON" -m "$ENTRY"
  "${SHARED_OVERRIDES[@]}"
  "${ASYNC_OVERRIDES[@]}"
  actor_rollout_ref.actor.strategy=fsdp
  actor_rollout_ref.model.use_remove_padding=False
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  "actor_rollout_ref.actor.fsdp_config.param_offload=$ACTOR_PARAM_OFFLOAD"
  "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$ACTOR_OPTIMIZER_OFFLOAD"
  "actor_rollout_ref.ref.fsdp_config.param_offload=$REF_PARAM_OFFLOAD"
  "${RUNTIME_ENV_OVERRIDES[@]}"
  "${EXTRA_ARGS[@]}"
)

recipe_preflight "${CMD[@]}"
recipe_log "FSDP $ASYNC_MODE, rollout=$ROLLOUT_PRECISION trainer=$TRAINER_NPUS NPUs rollout=$ROLLOUT_NNODES x $ROLLOUT_NPUS NPUs, checkpoint engine $CHECKPOINT_ENGINE"
run_or_print "${CMD[@]}"
