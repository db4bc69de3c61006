#!/usr/bin/env bash
# verl GRPO launch: Qwen2.5-7B, FSDP trainer, vLLM-Ascend rollout with INT8 weights through npu_flashrl,
# on one Atlas 800T A2 node (8x 910B). Settings follow the published Ascend INT8 recipe (MindSpeed-RL):
# prompt 2048 / response 10240, batch 16, mini-batch 8, n 4, dynamic batch (12288 tokens), lr 5e-8,
# KL loss 0.001 low_var_kl, rollout TP 4, gpu_memory_utilization 0.3, truncated importance sampling
# through verl's algorithm.rollout_correction.* (sequence level, threshold 2.0, batch-normalized, in
# decoupled mode: the published recipe's bypass mode + policy gradient does no TIS at verl 51d2104 and
# is refused), FP32 lm-head, DEBUG logs for the patch lines, HCCL settings.
#
# Normally started by ../flash_rl/grpo_qwen25_7b_fsdp_int8_A2.sh, which prepares FLASHRL_CONFIG.
#
# Usage: test_grpo_qwen25_7b_fsdp_int8_A2.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment (defaults in brackets):
#   ROLLOUT_PRECISION  int8 | bf16 [int8]; bf16 is the A/B baseline, identical except quantization
#   FLASHRL_CONFIG     npu_flashrl config YAML [required for int8; optional for bf16]
#   MODEL_PATH         HF checkpoint of the actor [$HOME/models/Qwen2.5-7B-Instruct]
#   DATASET            gsm8k | dapo [gsm8k]; DATA_DIR [$HOME/data/$DATASET]
#   TRAIN_FILE / VAL_FILE  parquet files [$DATA_DIR/train.parquet, $DATA_DIR/test.parquet]
#   NNODES [1]  NPUS_PER_NODE [8]  RAY_ADDRESS [empty: local Ray; head_ip:6379 for multi-node]
#   MAX_PROMPT_LENGTH [2048] MAX_RESPONSE_LENGTH [10240] TRAIN_BATCH_SIZE [16] PPO_MINI_BATCH_SIZE [8]
#   ROLLOUT_N [4] USE_DYNAMIC_BSZ [True] PPO_MAX_TOKEN_LEN [prompt+response = 12288] LR [5e-8]
#   KL_LOSS_COEF [0.001] KL_LOSS_TYPE [low_var_kl] ROLLOUT_TP [4] GPU_MEMORY_UTILIZATION [0.3]
#   MICRO_BATCH_PER_NPU [1] ENFORCE_EAGER [False] REF_PARAM_OFFLOAD [True] ACTOR_PARAM_OFFLOAD [False]
#   ACTOR_OPTIMIZER_OFFLOAD [False]
#   TIS_LEVEL [sequence] TIS_THRESHOLD [2.0] TIS_BATCH_NORMALIZE [True] TIS_BYPASS_MODE [False]
#   TIS_USE_POLICY_GRADIENT [False] (True, or bypass with TIS on, is refused: no TIS at verl 51d2104)
#   TOTAL_EPOCHS [5] SAVE_FREQ [-1] TEST_FREQ [5] LOGGER [console] PROJECT_NAME [npu_flashrl_grpo]
#   EXPERIMENT_NAME [qwen25_7b_fsdp_${ROLLOUT_PRECISION}_A2] CKPT_DIR [$HOME/npu_flashrl_runs/ckpts/...]
#   FLASHRL_LMHEAD_FP32 [1] FLASHRL_LOGGING_LEVEL [DEBUG] FLASHRL_LOGGING_FILE [empty]
#   VERL_LOGGING_LEVEL [DEBUG] VLLM_LOGGING_LEVEL [DEBUG]
#   HCCL_CONNECT_TIMEOUT [3000] HCCL_EXEC_TIMEOUT [3000] HCCL_HOST_SOCKET_PORT_RANGE [60000-60050]
#   HCCL_NPU_SOCKET_PORT_RANGE [61000-61050]
#   PYTHON [python3]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
parse_recipe_args "$@"
FEATURES=fsdp

grpo_defaults qwen25_7b_fsdp
grpo_inputs
grpo_worker_env
grpo_shared_overrides

# FSDP-specific: gradient checkpointing, parameter offload of actor and reference.
CMD=(
  env "${WORKER_ENV[@]}"
  "$PYTHON" -m verl.trainer.main_ppo
  "${SHARED_OVERRIDES[@]}"
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
recipe_log "FSDP, line=$RECIPE_LINE rollout=$ROLLOUT_PRECISION model=$MODEL_PATH data=$TRAIN_FILE nodes=$NNODES x $NPUS_PER_NODE NPUs"
run_or_print "${CMD[@]}"
