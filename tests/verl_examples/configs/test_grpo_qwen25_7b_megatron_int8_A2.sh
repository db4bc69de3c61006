#!/usr/bin/env bash
# verl GRPO launch with the Megatron trainer backend + MindSpeed on one Atlas 800T A2 node: Qwen2.5-7B,
# INT8 rollout on vLLM-Ascend through npu_flashrl. Same GRPO / rollout / TIS / logging / HCCL settings
# as test_grpo_qwen25_7b_fsdp_int8_A2.sh (shared through ../common.sh); only the trainer side differs:
# actor_rollout_ref.actor.strategy=megatron with verl's ppo_megatron_trainer config, Megatron
# parallelism, full recompute and MindSpeed's flash attention through override_transformer_config.
# verl imports mindspeed.megatron_adaptor before Megatron in every worker (verl/workers/engine/__init__.py)
# and at the top of its Megatron workers; MindSpeed must be installed (scripts/install_pinned.sh does it):
# with npu_flashrl active a Megatron worker without it refuses to start (docs/megatron.md).
#
# Normally started by ../flash_rl/grpo_qwen25_7b_megatron_int8_A2.sh, which prepares FLASHRL_CONFIG.
#
# Usage: test_grpo_qwen25_7b_megatron_int8_A2.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_fsdp_int8_A2.sh, plus (defaults in brackets)
#   TRAIN_TP [4] TRAIN_PP [1] TRAIN_CP [1]    Megatron tensor / pipeline / context parallel sizes
#   ACTOR_OFFLOAD [False]                      actor param, grad and optimizer offload
#   USE_DIST_CKPT [False] DIST_CKPT_PATH []    load a converted Megatron dist checkpoint instead of HF
#   USE_MBRIDGE [False]                        verl's mbridge HF<->Megatron conversion
#   USE_FLASH_ATTN [True]                      MindSpeed flash attention (+override_transformer_config)
#   RECOMPUTE_GRANULARITY [full] RECOMPUTE_METHOD [uniform] RECOMPUTE_NUM_LAYERS [1]
# With RECIPE_LINE=current (verl 0.9.1's Megatron / MindSpeed engine; the *_megatron_*_verl09
# recipes set it) also, and with these defaults:
#   USE_MBRIDGE [True] VANILLA_MBRIDGE [True]  verl 0.9 requires use_mbridge=True; vanilla_mbridge=True
#                                              exports through mbridge (what verl's Ascend install
#                                              script installs and npu_flashrl verified on CPU;
#                                              False: Megatron-Bridge, verl's default)
#   TRAIN_EP [1] TRAIN_ETP [1]                 Megatron expert / expert-tensor parallel sizes
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
parse_recipe_args "$@"
FEATURES=megatron

grpo_defaults qwen25_7b_megatron
TRAIN_TP="${TRAIN_TP:-4}"
TRAIN_PP="${TRAIN_PP:-1}"
TRAIN_CP="${TRAIN_CP:-1}"
ACTOR_OFFLOAD="${ACTOR_OFFLOAD:-False}"
USE_DIST_CKPT="${USE_DIST_CKPT:-False}"
DIST_CKPT_PATH="${DIST_CKPT_PATH:-}"
if [[ "$RECIPE_LINE" == current ]]; then USE_MBRIDGE="${USE_MBRIDGE:-True}"; else USE_MBRIDGE="${USE_MBRIDGE:-False}"; fi
VANILLA_MBRIDGE="${VANILLA_MBRIDGE:-True}"
TRAIN_EP="${TRAIN_EP:-1}"
TRAIN_ETP="${TRAIN_ETP:-1}"
USE_FLASH_ATTN="${USE_FLASH_ATTN:-True}"
RECOMPUTE_GRANULARITY="${RECOMPUTE_GRANULARITY:-full}"
RECOMPUTE_METHOD="${RECOMPUTE_METHOD:-uniform}"
RECOMPUTE_NUM_LAYERS="${RECOMPUTE_NUM_LAYERS:-1}"

grpo_inputs
if [[ "$USE_DIST_CKPT" == True ]]; then require_dir DIST_CKPT_PATH "$DIST_CKPT_PATH"; fi
grpo_worker_env
grpo_shared_overrides

MEGATRON_OVERRIDES=(
  actor_rollout_ref.actor.strategy=megatron
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.actor.use_torch_compile=False
  actor_rollout_ref.ref.use_torch_compile=False
  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TRAIN_TP"
  "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$TRAIN_PP"
  "actor_rollout_ref.actor.megatron.context_parallel_size=$TRAIN_CP"
  "actor_rollout_ref.actor.megatron.param_offload=$ACTOR_OFFLOAD"
  "actor_rollout_ref.actor.megatron.optimizer_offload=$ACTOR_OFFLOAD"
  "actor_rollout_ref.actor.megatron.use_dist_checkpointing=$USE_DIST_CKPT"
  "actor_rollout_ref.actor.megatron.use_mbridge=$USE_MBRIDGE"
  "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=$TRAIN_TP"
  "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=$TRAIN_PP"
  "actor_rollout_ref.ref.megatron.context_parallel_size=$TRAIN_CP"
  "actor_rollout_ref.ref.megatron.param_offload=$REF_PARAM_OFFLOAD"
  "actor_rollout_ref.ref.megatron.use_dist_checkpointing=$USE_DIST_CKPT"
  # MindSpeed options go through override_transformer_config (verl repatches MindSpeed with them);
  # use_flash_attn is not in verl's schema, hence '+'; the recompute keys are.
  "+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=$USE_FLASH_ATTN"
  "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=$RECOMPUTE_GRANULARITY"
  "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=$RECOMPUTE_METHOD"
  "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=$RECOMPUTE_NUM_LAYERS"
)
if [[ "$RECIPE_LINE" != current ]]; then
  # verl 51d2104's worker key (verl 0.9.1's engine config has no grad_offload: param_offload
  # covers the gradient buffers there)
  MEGATRON_OVERRIDES+=("actor_rollout_ref.actor.megatron.grad_offload=$ACTOR_OFFLOAD")
else
  # verl 0.9.1's engine keys (ppo_megatron_trainer): the bridge and expert parallelism
  MEGATRON_OVERRIDES+=(
    "actor_rollout_ref.actor.megatron.vanilla_mbridge=$VANILLA_MBRIDGE"
    "actor_rollout_ref.ref.megatron.use_mbridge=$USE_MBRIDGE"
    "actor_rollout_ref.ref.megatron.vanilla_mbridge=$VANILLA_MBRIDGE"
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=$TRAIN_EP"
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=$TRAIN_ETP"
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size=$TRAIN_EP"
    "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=$TRAIN_ETP"
  )
fi
if [[ -n "$DIST_CKPT_PATH" ]]; then
  MEGATRON_OVERRIDES+=(
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path=$(hydra_value "$DIST_CKPT_PATH")"
    "actor_rollout_ref.ref.megatron.dist_checkpointing_path=$(hydra_value "$DIST_CKPT_PATH")"
  )
fi

CMD=(
  env "${WORKER_ENV[@]}"
  "$PYTHON" -m verl.trainer.main_ppo
  --config-name=ppo_megatron_trainer
  "${SHARED_OVERRIDES[@]}"
  "${MEGATRON_OVERRIDES[@]}"
  "${RUNTIME_ENV_OVERRIDES[@]}"
  "${EXTRA_ARGS[@]}"
)

recipe_preflight "${CMD[@]}"
recipe_log "Megatron TP=$TRAIN_TP PP=$TRAIN_PP CP=$TRAIN_CP, rollout=$ROLLOUT_PRECISION model=$MODEL_PATH nodes=$NNODES x $NPUS_PER_NODE NPUs"
run_or_print "${CMD[@]}"
