#!/usr/bin/env bash
# shellcheck disable=SC2034  # the variables and arrays set here are used by the scripts that source common.sh
# Sourced by ../common.sh (not executed): the shared GRPO launch of the configs/*.sh scripts (defaults,
# inputs, worker environment, the Hydra overrides).
# grpo_defaults NAME: the shared GRPO settings of the configs/*.sh launch scripts. Every variable's
# default (line-dependent and derived ones too) is its `Var.default` in npu_flashrl/recipes/variables.py;
# `npu-flashrl preflight vars --resolve` checks what the user set, fills in the rest and prints the job
# (each variable, its value and where it came from). NAME starts EXPERIMENT_NAME.
grpo_defaults() {
  recipe_line
  recipe_vars --resolve --experiment "$1"
  export ROLLOUT_PRECISION  # the launch's preflight holds FLASHRL_CONFIG to it
}

# grpo_inputs: the files the launch reads (a dry run after the entry's setup step accepts the config
# that step would write).
grpo_inputs() {
  require_dir MODEL_PATH "$MODEL_PATH"
  require_file MODEL_PATH/config.json "$MODEL_PATH/config.json"
  require_file TRAIN_FILE "$TRAIN_FILE"
  require_file VAL_FILE "$VAL_FILE"
  if [[ "$ROLLOUT_PRECISION" != bf16 || -n "$FLASHRL_CONFIG" ]]; then
    if [[ "$DRY_RUN" == 1 && -n "$FLASHRL_CONFIG" && "${NPU_FLASHRL_PENDING_CONFIG:-}" == "$FLASHRL_CONFIG" ]]; then
      recipe_log "dry run: FLASHRL_CONFIG $FLASHRL_CONFIG would be created by npu-flashrl setup"
    else
      require_file FLASHRL_CONFIG "$FLASHRL_CONFIG"
    fi
  fi
}
# WORKER_ENV (KEY=VALUE for `env`) and RUNTIME_ENV_OVERRIDES (the same variables in Ray's runtime env,
# as quoted strings, so that workers on every node of a multi-node cluster see them).
grpo_worker_env() {
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
    if [[ -n "$FLASHRL_LOGGING_FILE" ]]; then WORKER_ENV+=("FLASHRL_LOGGING_FILE=$FLASHRL_LOGGING_FILE"); fi
  fi
  RUNTIME_ENV_OVERRIDES=()
  local kv
  for kv in "${WORKER_ENV[@]}"; do
    RUNTIME_ENV_OVERRIDES+=("+ray_kwargs.ray_init.runtime_env.env_vars.${kv%%=*}=$(hydra_str "${kv#*=}")")
  done
  if [[ -n "$FLASHRL_CONFIG" ]]; then
    # activate npu_flashrl in every Ray worker before verl builds a model (trainer-side FP32
    # lm-head, MindSpeed import order); the vLLM plugin alone fires only at rollout start
    RUNTIME_ENV_OVERRIDES+=("+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=npu_flashrl.activation.worker_process_setup")
  fi
  if [[ -n "$RAY_ADDRESS" ]]; then WORKER_ENV+=("RAY_ADDRESS=$RAY_ADDRESS"); fi
}

# SHARED_OVERRIDES: the Hydra overrides both trainer backends and both lines use; LINE_OVERRIDES,
# appended to them, the keys of one line (51d2104 or 0.9.1 names).
grpo_shared_overrides() {
  if [[ "$RECIPE_LINE" == current ]]; then
    LINE_OVERRIDES=(
      # no rollout.mode: server mode (async) is verl 0.9's only one
      "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=$UPDATE_WEIGHTS_BUCKET_MB"
    )
  else
    LINE_OVERRIDES=(
      actor_rollout_ref.rollout.mode=sync
      "algorithm.rollout_correction.use_policy_gradient=$TIS_USE_POLICY_GRADIENT"
    )
  fi
  SHARED_OVERRIDES=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    "data.train_files=$(hydra_value "$TRAIN_FILE")"
    "data.val_files=$(hydra_value "$VAL_FILE")"
    "data.train_batch_size=$TRAIN_BATCH_SIZE"
    "data.max_prompt_length=$MAX_PROMPT_LENGTH"
    "data.max_response_length=$MAX_RESPONSE_LENGTH"
    data.filter_overlong_prompts=True
    data.truncation=error
    "actor_rollout_ref.model.path=$(hydra_value "$MODEL_PATH")"
    "actor_rollout_ref.actor.optim.lr=$LR"
    "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE"
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_PER_NPU"
    "actor_rollout_ref.actor.use_dynamic_bsz=$USE_DYNAMIC_BSZ"
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN"
    actor_rollout_ref.actor.use_kl_loss=True
    "actor_rollout_ref.actor.kl_loss_coef=$KL_LOSS_COEF"
    "actor_rollout_ref.actor.kl_loss_type=$KL_LOSS_TYPE"
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    "actor_rollout_ref.rollout.n=$ROLLOUT_N"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION"
    actor_rollout_ref.rollout.enable_chunked_prefill=False
    "actor_rollout_ref.rollout.max_num_batched_tokens=$PPO_MAX_TOKEN_LEN"
    "actor_rollout_ref.rollout.enforce_eager=$ENFORCE_EAGER"
    actor_rollout_ref.rollout.calculate_log_probs=True
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH_PER_NPU"
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH_PER_NPU"
    "algorithm.rollout_correction.rollout_is=$TIS_LEVEL"
    "algorithm.rollout_correction.rollout_is_threshold=$TIS_THRESHOLD"
    "algorithm.rollout_correction.rollout_is_batch_normalize=$TIS_BATCH_NORMALIZE"
    "algorithm.rollout_correction.bypass_mode=$TIS_BYPASS_MODE"
    trainer.critic_warmup=0
    "trainer.logger=$LOGGER"
    "trainer.project_name=$(hydra_value "$PROJECT_NAME")"
    "trainer.experiment_name=$(hydra_value "$EXPERIMENT_NAME")"
    "trainer.default_local_dir=$(hydra_value "$CKPT_DIR")"
    "trainer.n_gpus_per_node=$NPUS_PER_NODE"
    "trainer.nnodes=$NNODES"
    "trainer.save_freq=$SAVE_FREQ"
    "trainer.test_freq=$TEST_FREQ"
    "trainer.total_epochs=$TOTAL_EPOCHS"
    trainer.device=npu
    "${LINE_OVERRIDES[@]}"
  )
}
