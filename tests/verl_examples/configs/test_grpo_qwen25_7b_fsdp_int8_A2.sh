#!/usr/bin/env bash
# verl GRPO launch: Qwen2.5-7B, FSDP trainer, vLLM-Ascend rollout with INT8 weights through npu_flashrl,
# on one Atlas 800T A2 node (8x 910B). Settings follow the published Ascend INT8 recipe (MindSpeed-RL):
# prompt 2048 / response 10240, batch 16, mini-batch 8, n 4, dynamic batch (12288 tokens), lr 5e-8,
# KL loss 0.001 low_var_kl, rollout TP 4, gpu_memory_utilization 0.3, truncated importance sampling
# through verl's algorithm.rollout_correction.* (sequence level, threshold 2.0, batch-normalized,
# bypass mode, policy gradient), FP32 lm-head, DEBUG logs for the patch lines, HCCL settings.
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
#   TIS_LEVEL [sequence] TIS_THRESHOLD [2.0] TIS_BATCH_NORMALIZE [True] TIS_BYPASS_MODE [True]
#   TIS_USE_POLICY_GRADIENT [True]
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

ROLLOUT_PRECISION="${ROLLOUT_PRECISION:-int8}"
MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-7B-Instruct}"
DATASET="${DATASET:-gsm8k}"
DATA_DIR="${DATA_DIR:-$HOME/data/$DATASET}"
TRAIN_FILE="${TRAIN_FILE:-$DATA_DIR/train.parquet}"
VAL_FILE="${VAL_FILE:-$DATA_DIR/test.parquet}"
FLASHRL_CONFIG="${FLASHRL_CONFIG:-}"

NNODES="${NNODES:-1}"
NPUS_PER_NODE="${NPUS_PER_NODE:-8}"
RAY_ADDRESS="${RAY_ADDRESS:-}"

MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-2048}"
MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-10240}"
TRAIN_BATCH_SIZE="${TRAIN_BATCH_SIZE:-16}"
PPO_MINI_BATCH_SIZE="${PPO_MINI_BATCH_SIZE:-8}"
ROLLOUT_N="${ROLLOUT_N:-4}"
USE_DYNAMIC_BSZ="${USE_DYNAMIC_BSZ:-True}"
PPO_MAX_TOKEN_LEN="${PPO_MAX_TOKEN_LEN:-$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))}"
LR="${LR:-5e-8}"
KL_LOSS_COEF="${KL_LOSS_COEF:-0.001}"
KL_LOSS_TYPE="${KL_LOSS_TYPE:-low_var_kl}"
ROLLOUT_TP="${ROLLOUT_TP:-4}"
GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-0.3}"
MICRO_BATCH_PER_NPU="${MICRO_BATCH_PER_NPU:-1}"
ENFORCE_EAGER="${ENFORCE_EAGER:-False}"
REF_PARAM_OFFLOAD="${REF_PARAM_OFFLOAD:-True}"
ACTOR_PARAM_OFFLOAD="${ACTOR_PARAM_OFFLOAD:-False}"

TIS_LEVEL="${TIS_LEVEL:-sequence}"
TIS_THRESHOLD="${TIS_THRESHOLD:-2.0}"
TIS_BATCH_NORMALIZE="${TIS_BATCH_NORMALIZE:-True}"
TIS_BYPASS_MODE="${TIS_BYPASS_MODE:-True}"
TIS_USE_POLICY_GRADIENT="${TIS_USE_POLICY_GRADIENT:-True}"

TOTAL_EPOCHS="${TOTAL_EPOCHS:-5}"
SAVE_FREQ="${SAVE_FREQ:--1}"
TEST_FREQ="${TEST_FREQ:-5}"
LOGGER="${LOGGER:-console}"
PROJECT_NAME="${PROJECT_NAME:-npu_flashrl_grpo}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-qwen25_7b_fsdp_${ROLLOUT_PRECISION}_A2}"
CKPT_DIR="${CKPT_DIR:-$HOME/npu_flashrl_runs/ckpts/$PROJECT_NAME/$EXPERIMENT_NAME}"
PYTHON="${PYTHON:-python3}"

# Environment of every worker (also put into Ray's runtime env so that other nodes get it too).
FLASHRL_LMHEAD_FP32="${FLASHRL_LMHEAD_FP32:-1}"
FLASHRL_LOGGING_LEVEL="${FLASHRL_LOGGING_LEVEL:-DEBUG}"
FLASHRL_LOGGING_FILE="${FLASHRL_LOGGING_FILE:-}"
VERL_LOGGING_LEVEL="${VERL_LOGGING_LEVEL:-DEBUG}"
VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-DEBUG}"
HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-3000}"
HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-3000}"
HCCL_HOST_SOCKET_PORT_RANGE="${HCCL_HOST_SOCKET_PORT_RANGE:-60000-60050}"
HCCL_NPU_SOCKET_PORT_RANGE="${HCCL_NPU_SOCKET_PORT_RANGE:-61000-61050}"

# ---------------------------------------------------------------- preflight (cheap, before Ray starts)
case "$ROLLOUT_PRECISION" in
  int8|bf16) ;;
  *) recipe_die "ROLLOUT_PRECISION must be int8 or bf16, got '$ROLLOUT_PRECISION'" ;;
esac
case "$TIS_LEVEL" in
  null|token|sequence) ;;
  *) recipe_die "TIS_LEVEL must be null, token or sequence (verl algorithm.rollout_correction.rollout_is), got '$TIS_LEVEL'" ;;
esac
require_dir MODEL_PATH "$MODEL_PATH"
require_file MODEL_PATH/config.json "$MODEL_PATH/config.json"
require_file TRAIN_FILE "$TRAIN_FILE"
require_file VAL_FILE "$VAL_FILE"
if [[ "$ROLLOUT_PRECISION" == int8 || -n "$FLASHRL_CONFIG" ]]; then
  # The entry script may announce a config it would create in a dry run.
  if [[ "$DRY_RUN" == 1 && "${NPU_FLASHRL_PENDING_CONFIG:-}" == "$FLASHRL_CONFIG" && -n "$FLASHRL_CONFIG" ]]; then
    recipe_log "dry run: FLASHRL_CONFIG $FLASHRL_CONFIG would be created by npu-flashrl setup"
  else
    require_file FLASHRL_CONFIG "$FLASHRL_CONFIG"
  fi
fi
if (( ROLLOUT_TP > NPUS_PER_NODE )); then
  recipe_die "ROLLOUT_TP=$ROLLOUT_TP exceeds NPUS_PER_NODE=$NPUS_PER_NODE"
fi
if [[ "$DRY_RUN" == 0 ]]; then
  require_cmd "$PYTHON" "set PYTHON to the interpreter of the pinned stack"
  if [[ -n "$FLASHRL_CONFIG" ]]; then
    "$PYTHON" -c 'import npu_flashrl' 2>/dev/null \
      || recipe_die "npu_flashrl is not importable by $PYTHON (run scripts/install_pinned.sh)"
  fi
fi

# ---------------------------------------------------------------- environment
WORKER_ENV=(
  "HCCL_CONNECT_TIMEOUT=$HCCL_CONNECT_TIMEOUT"
  "HCCL_EXEC_TIMEOUT=$HCCL_EXEC_TIMEOUT"
  "HCCL_HOST_SOCKET_PORT_RANGE=$HCCL_HOST_SOCKET_PORT_RANGE"
  "HCCL_NPU_SOCKET_PORT_RANGE=$HCCL_NPU_SOCKET_PORT_RANGE"
  "VERL_LOGGING_LEVEL=$VERL_LOGGING_LEVEL"
  "VLLM_LOGGING_LEVEL=$VLLM_LOGGING_LEVEL"
)
if [[ -n "$FLASHRL_CONFIG" ]]; then
  WORKER_ENV+=(
    "FLASHRL_CONFIG=$FLASHRL_CONFIG"
    "FLASHRL_LMHEAD_FP32=$FLASHRL_LMHEAD_FP32"
    "FLASHRL_LOGGING_LEVEL=$FLASHRL_LOGGING_LEVEL"
  )
  [[ -n "$FLASHRL_LOGGING_FILE" ]] && WORKER_ENV+=("FLASHRL_LOGGING_FILE=$FLASHRL_LOGGING_FILE")
fi
[[ -n "$RAY_ADDRESS" ]] && WORKER_ENV+=("RAY_ADDRESS=$RAY_ADDRESS")

# Ray runtime env: string values, quoted for Hydra, so workers on every node see the same variables.
RUNTIME_ENV_OVERRIDES=()
for kv in "${WORKER_ENV[@]}"; do
  [[ "${kv%%=*}" == RAY_ADDRESS ]] && continue
  RUNTIME_ENV_OVERRIDES+=("+ray_kwargs.ray_init.runtime_env.env_vars.${kv%%=*}='${kv#*=}'")
done

# ---------------------------------------------------------------- verl command
CMD=(
  env "${WORKER_ENV[@]}"
  "$PYTHON" -m verl.trainer.main_ppo
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=False
  "data.train_files=$TRAIN_FILE"
  "data.val_files=$VAL_FILE"
  "data.train_batch_size=$TRAIN_BATCH_SIZE"
  "data.max_prompt_length=$MAX_PROMPT_LENGTH"
  "data.max_response_length=$MAX_RESPONSE_LENGTH"
  data.filter_overlong_prompts=True
  data.truncation=error
  "actor_rollout_ref.model.path=$MODEL_PATH"
  actor_rollout_ref.model.use_remove_padding=False
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  "actor_rollout_ref.actor.optim.lr=$LR"
  "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE"
  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_PER_NPU"
  "actor_rollout_ref.actor.use_dynamic_bsz=$USE_DYNAMIC_BSZ"
  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN"
  actor_rollout_ref.actor.use_kl_loss=True
  "actor_rollout_ref.actor.kl_loss_coef=$KL_LOSS_COEF"
  "actor_rollout_ref.actor.kl_loss_type=$KL_LOSS_TYPE"
  actor_rollout_ref.actor.entropy_coeff=0
  "actor_rollout_ref.actor.fsdp_config.param_offload=$ACTOR_PARAM_OFFLOAD"
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.mode=sync
  "actor_rollout_ref.rollout.n=$ROLLOUT_N"
  "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
  "actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION"
  actor_rollout_ref.rollout.enable_chunked_prefill=False
  "actor_rollout_ref.rollout.max_num_batched_tokens=$PPO_MAX_TOKEN_LEN"
  "actor_rollout_ref.rollout.enforce_eager=$ENFORCE_EAGER"
  actor_rollout_ref.rollout.calculate_log_probs=True
  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH_PER_NPU"
  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH_PER_NPU"
  "actor_rollout_ref.ref.fsdp_config.param_offload=$REF_PARAM_OFFLOAD"
  "algorithm.rollout_correction.rollout_is=$TIS_LEVEL"
  "algorithm.rollout_correction.rollout_is_threshold=$TIS_THRESHOLD"
  "algorithm.rollout_correction.rollout_is_batch_normalize=$TIS_BATCH_NORMALIZE"
  "algorithm.rollout_correction.bypass_mode=$TIS_BYPASS_MODE"
  "algorithm.rollout_correction.use_policy_gradient=$TIS_USE_POLICY_GRADIENT"
  trainer.critic_warmup=0
  "trainer.logger=$LOGGER"
  "trainer.project_name=$PROJECT_NAME"
  "trainer.experiment_name=$EXPERIMENT_NAME"
  "trainer.default_local_dir=$CKPT_DIR"
  "trainer.n_gpus_per_node=$NPUS_PER_NODE"
  "trainer.nnodes=$NNODES"
  "trainer.save_freq=$SAVE_FREQ"
  "trainer.test_freq=$TEST_FREQ"
  "trainer.total_epochs=$TOTAL_EPOCHS"
  trainer.device=npu
  "${RUNTIME_ENV_OVERRIDES[@]}"
  "${EXTRA_ARGS[@]}"
)

recipe_log "rollout=$ROLLOUT_PRECISION model=$MODEL_PATH data=$TRAIN_FILE nodes=$NNODES x $NPUS_PER_NODE NPUs"
run_or_print "${CMD[@]}"
