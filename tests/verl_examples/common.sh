#!/usr/bin/env bash
# shellcheck disable=SC2034  # the variables and arrays set here are used by the scripts that source this file
# Helpers shared by the npu_flashrl verl recipes (sourced, not executed): defaults and command
# assembly. Every rule about the values (types and ranges of the variables, the layout, the TIS /
# server-mode / checkpoint-engine rules of the recipe's verl line, verl's override schema) is
# npu_flashrl's `npu-flashrl preflight` (npu_flashrl/recipes/), which recipe_vars and
# recipe_preflight run with $PYTHON before anything expensive starts. Every recipe: `set -euo
# pipefail`, tunables as env vars with defaults, `--dry-run` prints the full command without
# launching anything.
DRY_RUN="${DRY_RUN:-0}"
EXTRA_ARGS=()

# The recipe the user ran names every message, also after it handed over to another script (a twin's
# exec, an entry's config script).
RECIPE_NAME="${NPU_FLASHRL_RECIPE:-$(basename "$0" .sh)}"
export NPU_FLASHRL_RECIPE="$RECIPE_NAME"
recipe_log() { printf '[%s] %s\n' "$RECIPE_NAME" "$*" >&2; }
recipe_die() { printf '[%s] ERROR: %s\n' "$RECIPE_NAME" "$*" >&2; exit 1; }
recipe_usage_die() { printf '[%s] ERROR: %s (see --help)\n' "$RECIPE_NAME" "$*" >&2; exit 2; }

# print_header: the calling script's header comment (its --help).
print_header() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# recipe_help "$@": --help/-h anywhere prints the calling script's header and exits; for the scripts
# that hand over to another one with exec (which would print its own header instead).
recipe_help() { local a; for a in "$@"; do case "$a" in -h|--help) print_header; exit 0 ;; esac; done; }

# parse_recipe_args "$@": --dry-run / -n, --help / -h (prints the header comment); any other word
# starting with '-' is refused (a typo such as --dryrun must not launch the real job; Hydra overrides
# never start with '-'); the rest is kept in EXTRA_ARGS and appended to the verl command.
parse_recipe_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --dry-run|-n) DRY_RUN=1 ;;
      -h|--help) print_header; exit 0 ;;
      -*) recipe_usage_die "unknown option '$1': this recipe knows --dry-run/-n and --help/-h; extra Hydra overrides are key=value words" ;;
      *) EXTRA_ARGS+=("$1") ;;
    esac
    shift
  done
  export DRY_RUN
}

# Recipe features for the preflight (fsdp | megatron, async; RECIPE_MOE=1 adds moe) and its extra
# options (--node-npus for a separate rollout pool); set by the config scripts.
FEATURES=""
PREFLIGHT_ARGS=()

# run_preflight PHASE [-- COMMAND...]: `npu-flashrl preflight PHASE` with the recipe's interpreter
# (python -m npu_flashrl.recipes.preflight: the CLI without its torch import). Its messages go to
# stderr; exit 3 is a refusal, anything else means $PYTHON cannot run npu_flashrl. The NAME=value
# lines it prints (normalised variables, e.g. booleans as True/False) are taken over. Importing
# npu_flashrl must not activate it here (FLASHRL_CONFIG may be exported already).
run_preflight() {
  local out rc=0 line features="${FEATURES}" dry=()
  [[ "${RECIPE_MOE:-0}" == 1 ]] && features+=",moe"
  [[ "$DRY_RUN" == 1 ]] && dry=(--dry-run)
  out="$(NPU_FLASHRL_NO_AUTOACTIVATE=1 "$PYTHON" -m npu_flashrl.recipes.preflight "$1" --name "$RECIPE_NAME" --line "$RECIPE_LINE" \
    --features "$features" --hint "$INSTALL_HINT" "${dry[@]}" "${PREFLIGHT_ARGS[@]}" "${@:2}")" || rc=$?
  [[ "$rc" == 3 ]] && exit 1
  if [[ "$rc" != 0 || "$out" != *NPU_FLASHRL_PREFLIGHT=ok* ]]; then
    recipe_die "npu-flashrl preflight did not run with PYTHON=$PYTHON (exit $rc): install npu_flashrl for that interpreter ($INSTALL_HINT) or set PYTHON"
  fi
  while IFS= read -r line; do
    if [[ "$line" =~ ^[A-Z][A-Z0-9_]*= ]]; then printf -v "${line%%=*}" '%s' "${line#*=}"; fi
  done <<<"$out"
}
# recipe_vars [--resolve [--experiment NAME]]: the recipe variables set in the environment; with
# --resolve every variable the recipe reads, defaults filled in.
recipe_vars() { run_preflight vars "$@"; }

# recipe_sets NAME VALUE: this recipe runs with NAME=VALUE (exported). A different value the user
# (or a calling script) set is refused naming both: a recipe never replaces the user's word.
recipe_sets() {
  local current="${!1-}"
  if [[ -n "$current" && "$current" != "$2" ]]; then
    recipe_die "$1=$current is set, but this recipe runs with $1=$2: unset $1, or run the recipe for $1=$current"
  fi
  export "$1=$2"
}

# flashrl_baseline_entry CONFIG_SCRIPT ARGS...: the bf16 entry scripts. BASELINE_NPU_FLASHRL read as the
# preflight reads booleans (False, false, 0): plain verl without npu_flashrl; else flashrl_entry.
flashrl_baseline_entry() {
  recipe_sets FLASHRL_FN bf16
  recipe_line
  FEATURES="entry,any" recipe_vars
  if [[ "${BASELINE_NPU_FLASHRL:-True}" == False ]]; then
    recipe_sets ROLLOUT_PRECISION bf16
    recipe_sets FLASHRL_CONFIG ""
    exec bash "$1" "${@:2}"
  fi
  flashrl_entry "$@"
}
# recipe_preflight COMMAND...: the assembled verl command (and, on a real run, the installed verl).
recipe_preflight() { run_preflight launch -- "$@"; }


# hydra_value VALUE: VALUE as one Hydra override value that reads back as the same string. Plain
# paths and names stay as they are; anything else (non-ASCII, spaces, ( ) = # [ ] { } ~ & ' " $ \ ,
# or a word Hydra would type, such as null or 1e5) is double-quoted the way Hydra's override grammar
# takes quoted values: a backslash before each quote, backslashes doubled where they end the value
# or precede a quote, and '${' written '\${' (else OmegaConf would interpolate it).
# hydra_str VALUE: the same, always single-quoted (Ray's runtime env takes strings only: '3000').
hydra_value() {
  if [[ "$1" =~ ^[A-Za-z_/.][A-Za-z0-9_/.@%+-]*$ && ! "${1,,}" =~ ^(true|false|null|nan|inf)$ ]]; then
    printf '%s' "$1"
  else
    hydra_quote '"' "$1"
  fi
}
hydra_str() { hydra_quote "'" "$1"; }
hydra_quote() {
  local q="$1" s="$2" out="" run="" c i
  for (( i = 0; i < ${#s}; i++ )); do
    c="${s:i:1}"
    case "$c" in
      \\) run+="\\" ;;
      "$q") out+="$run$run\\$q"; run="" ;;
      '$') if [[ "${s:i+1:1}" == '{' ]]; then out+="$run"'\$'; else out+="$run$c"; fi; run="" ;;
      *) out+="$run$c"; run="" ;;
    esac
  done
  printf '%s%s%s' "$q" "$out$run$run" "$q"
}

# require_dir NAME VALUE / require_file NAME VALUE: stop with a message naming the variable and path.
require_dir() { [[ -n "$2" && -d "$2" ]] || recipe_die "$1 not found: '$2' (set $1=/path/to/dir)"; }
require_file() { [[ -n "$2" && -f "$2" ]] || recipe_die "$1 not found: '$2' (set $1=/path/to/file)"; }
require_cmd() { command -v "$1" >/dev/null 2>&1 || recipe_die "command '$1' not found on PATH ($2)"; }

# shell_word WORD: WORD quoted for a POSIX shell. %q, except for a word with non-ASCII characters,
# which %q writes as $'\346...' in a C locale (neither POSIX sh nor Python's shlex, which
# `npu-flashrl verify --verl-overrides -` reads this with, knows that form): single quotes instead.
shell_word() {
  if [[ "$1" == *[![:ascii:]]* ]]; then
    local q="'\\''"
    printf "'%s'" "${1//\'/$q}"
  else
    printf '%q' "$1"
  fi
}

# print_cmd ARGS...: one shell-quoted command, ready to copy-paste; every KEY=VALUE word (environment
# assignment or Hydra override) starts a continued line of its own.
print_cmd() {
  local first=1 a
  for a in "$@"; do
    if [[ "$first" == 1 ]]; then
      shell_word "$a"; first=0
    elif [[ "$a" =~ ^[+~]?[A-Za-z_][A-Za-z0-9_.]*= ]]; then
      printf ' \\\n    '; shell_word "$a"
    else
      printf ' '; shell_word "$a"
    fi
  done
  printf '\n'
}

# run_or_print ARGS...: print the command; execute it unless --dry-run.
run_or_print() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '# dry run, not executed:\n'
    print_cmd "$@"
  else
    recipe_log "+ $*"
    "$@"
  fi
}

# ---------------------------------------------------------------------------------------------------
# The stack line a recipe is written for (set by the recipe, not by users; see docs/quickstart_current.md):
#   pinned   verl 51d2104 + vLLM 0.10.1 / vllm-ascend v0.10.1rc1: rollout.mode=sync, in-process vLLM;
#   current  verl 0.9.1 + vLLM / vllm-ascend 0.23.0: server mode (verl 0.7+ removed sync), weights
#            arrive in buckets (rollout.checkpoint_engine.*), no use_policy_gradient key.
# The recipes of both lines share everything else below; `recipe_line` is the one switch.
recipe_line() {
  RECIPE_LINE="${RECIPE_LINE:-pinned}"
  PYTHON="${PYTHON:-python3}"  # the stack's interpreter: runs the preflight and verl
  case "$RECIPE_LINE" in
    pinned) INSTALL_HINT="scripts/install_pinned.sh" ;;
    current) INSTALL_HINT="scripts/install_pinned.sh --line current" ;;
    *) recipe_die "RECIPE_LINE must be pinned or current, got '$RECIPE_LINE'" ;;
  esac
  export RECIPE_LINE
}

# ---------------------------------------------------------------------------------------------------
# flashrl_entry CONFIG_SCRIPT ARGS...: the shared body of the flash_rl/*.sh entry recipes.
#  1. preflight: the variables set (npu-flashrl preflight vars), model dir, data files, W8A8
#     checkpoint when a profile must be made, the CLI;
#  2. `npu-flashrl profile` when the profile is missing (fn int8 only);
#  3. `npu-flashrl setup` when the config is missing;
#  4. runs CONFIG_SCRIPT with FLASHRL_CONFIG exported (and --dry-run passed through).
# Environment: see the header of flash_rl/grpo_qwen25_7b_fsdp_int8_A2.sh.
flashrl_entry() {
  local config_script="$1"; shift
  parse_recipe_args "$@"
  recipe_line
  # the variables set now, and the entry's defaults (variables.py): the profile and setup steps run
  # before the config script
  FEATURES="entry,any" recipe_vars --resolve
  export MODEL_PATH FLASHRL_CONFIG ROLLOUT_PRECISION DATASET DATA_DIR TRAIN_FILE VAL_FILE PYTHON

  # 1. inputs
  require_dir MODEL_PATH "$MODEL_PATH"
  require_file TRAIN_FILE "$TRAIN_FILE"
  require_file VAL_FILE "$VAL_FILE"
  require_file CONFIG_SCRIPT "$config_script"
  local need_profile=0 need_config=0
  [[ "$FLASHRL_FN" == int8 && ! -f "$PROFILE_PATH" ]] && need_profile=1
  [[ ! -f "$FLASHRL_CONFIG" ]] && need_config=1
  # the FlashRL profile compares the bf16 model with its W8A8 (compressed-tensors) checkpoint, which
  # is also the int8 config's model
  if [[ "$FLASHRL_FN" == int8 && ( "$need_profile" == 1 || "$need_config" == 1 ) ]]; then
    require_dir QUANT_MODEL_PATH "$QUANT_MODEL_PATH"
  fi
  if [[ "$DRY_RUN" == 0 && ( "$need_profile" == 1 || "$need_config" == 1 ) ]]; then
    require_cmd "$NPU_FLASHRL_CLI" "install npu_flashrl ($INSTALL_HINT) or set NPU_FLASHRL_CLI"
  fi

  # 2. profile
  if [[ "$need_profile" == 1 ]]; then
    recipe_log "profile missing: $PROFILE_PATH"
    run_or_print mkdir -p "$(dirname "$PROFILE_PATH")"
    run_or_print "$NPU_FLASHRL_CLI" profile -m "$MODEL_PATH" -q "$QUANT_MODEL_PATH" -o "$PROFILE_PATH" --fn int8
  elif [[ "$FLASHRL_FN" == int8 ]]; then
    recipe_log "profile present: $PROFILE_PATH"
  fi

  # 3. config (-m: the W8A8 checkpoint for int8, the bf16 checkpoint for int8_profile_free /
  #    w4a8_profile_free / bf16)
  if [[ "$need_config" == 1 ]]; then
    recipe_log "config missing: $FLASHRL_CONFIG"
    local setup=("$NPU_FLASHRL_CLI" setup)
    case "$FLASHRL_FN" in
      int8) setup+=(-m "$QUANT_MODEL_PATH" -p "$PROFILE_PATH") ;;
      *) setup+=(-m "$MODEL_PATH") ;;
    esac
    setup+=(--fn "$FLASHRL_FN" -o "$FLASHRL_CONFIG")
    local extra=()
    [[ -n "$SETUP_EXTRA" ]] && read -r -a extra <<<"$SETUP_EXTRA"
    setup+=("${extra[@]}")
    run_or_print mkdir -p "$(dirname "$FLASHRL_CONFIG")"
    run_or_print "${setup[@]}"
    [[ "$DRY_RUN" == 1 ]] && export NPU_FLASHRL_PENDING_CONFIG="$FLASHRL_CONFIG"
  else
    recipe_log "config present: $FLASHRL_CONFIG"
  fi

  # 4. launch
  local pass=()
  [[ "$DRY_RUN" == 1 ]] && pass+=(--dry-run)
  bash "$config_script" "${pass[@]}" "${EXTRA_ARGS[@]}"
}

# ---------------------------------------------------------------------------------------------------
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
