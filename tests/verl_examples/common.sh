#!/usr/bin/env bash
# shellcheck disable=SC2034  # the variables and arrays set here are used by the scripts that source this file
# Helpers shared by the npu_flashrl verl recipes (sourced, not executed).
# Every recipe: `set -euo pipefail`, tunables as env vars with defaults, `--dry-run` prints the full
# command without launching anything, preflight checks stop before anything expensive starts.

DRY_RUN="${DRY_RUN:-0}"
EXTRA_ARGS=()

recipe_log() { printf '[%s] %s\n' "$(basename "$0" .sh)" "$*" >&2; }
recipe_die() { printf '[%s] ERROR: %s\n' "$(basename "$0" .sh)" "$*" >&2; exit 1; }
recipe_usage_die() { printf '[%s] ERROR: %s (see --help)\n' "$(basename "$0" .sh)" "$*" >&2; exit 2; }

# print_header: the calling script's header comment (its --help).
print_header() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# recipe_help "$@": --help/-h anywhere prints the calling script's header and exits; for the scripts
# that hand over to another one with exec (which would print its own header instead).
recipe_help() {
  local a
  for a in "$@"; do
    case "$a" in -h|--help) print_header; exit 0 ;; esac
  done
}

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

# Numeric tunables (NAME:MIN[:MAX] for integers, MAX default 999999999), checked whenever set,
# before anything runs: bash arithmetic would misread '8x', 'eight' or '08' (and evaluate 'a[$(cmd)]'),
# wraps around past 2^63, and verl would only fail after Ray started. The digit count is checked
# before any arithmetic, so no comparison here can overflow.
RECIPE_INT_VARS=(NNODES:1:65536 NPUS_PER_NODE:1:65536 MAX_PROMPT_LENGTH:1 MAX_RESPONSE_LENGTH:1 TRAIN_BATCH_SIZE:1
  PPO_MINI_BATCH_SIZE:1 ROLLOUT_N:1 PPO_MAX_TOKEN_LEN:1 ROLLOUT_TP:1:65536 MICRO_BATCH_PER_NPU:1 TOTAL_EPOCHS:1
  SAVE_FREQ:-1 TEST_FREQ:-1 HCCL_CONNECT_TIMEOUT:1 HCCL_EXEC_TIMEOUT:1 TRAIN_TP:1:65536 TRAIN_PP:1:65536 TRAIN_CP:1:65536
  RECOMPUTE_NUM_LAYERS:1 UPDATE_WEIGHTS_BUCKET_MB:1:1048576 ROLLOUT_DP:1:65536 ROLLOUT_EP:1:65536)
RECIPE_FLOAT_VARS=(LR KL_LOSS_COEF GPU_MEMORY_UTILIZATION TIS_THRESHOLD)
# Switches passed to verl as Hydra booleans (1/0 and any case are accepted and written as True/False).
RECIPE_BOOL_VARS=(USE_DYNAMIC_BSZ ENFORCE_EAGER REF_PARAM_OFFLOAD ACTOR_PARAM_OFFLOAD
  ACTOR_OPTIMIZER_OFFLOAD TIS_BATCH_NORMALIZE ACTOR_OFFLOAD USE_DIST_CKPT USE_MBRIDGE USE_FLASH_ATTN)

# check_numeric_vars: every set variable of the lists above is a plain number (integers in
# [MIN, MAX]) or a boolean; FLASHRL_LMHEAD_FP32 is one of npu_flashrl's spellings.
check_numeric_vars() {
  local spec name min max value
  for spec in "${RECIPE_INT_VARS[@]}"; do
    IFS=: read -r name min max <<<"$spec"
    max="${max:-999999999}"
    value="${!name-}"
    [[ -z "$value" ]] && continue
    if [[ ! "$value" =~ ^-?(0|[1-9][0-9]*)$ ]] || (( ${#value} > ${#max} )) || (( value < min || value > max )); then
      recipe_die "$name must be an integer >= $min and <= $max, got '$value'"
    fi
  done
  for name in "${RECIPE_FLOAT_VARS[@]}"; do
    value="${!name-}"
    [[ -z "$value" ]] && continue
    [[ "$value" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] \
      || recipe_die "$name must be a non-negative number (e.g. 0.3 or 5e-8), got '$value'"
  done
  if [[ -n "${GPU_MEMORY_UTILIZATION:-}" ]] \
      && ! awk -v v="$GPU_MEMORY_UTILIZATION" 'BEGIN { exit !(v > 0 && v <= 1) }'; then
    recipe_die "GPU_MEMORY_UTILIZATION must be in (0, 1], got '$GPU_MEMORY_UTILIZATION'"
  fi
  if [[ -n "${TIS_THRESHOLD:-}" ]] \
      && ! awk -v v="$TIS_THRESHOLD" 'BEGIN { exit !(v > 0 && v < 1e300) }'; then
    recipe_die "TIS_THRESHOLD (algorithm.rollout_correction.rollout_is_threshold) must be a positive number, got '$TIS_THRESHOLD'"
  fi
  for name in "${RECIPE_BOOL_VARS[@]}"; do
    value="${!name-}"
    [[ -z "$value" ]] && continue
    case "${value,,}" in
      true|1) printf -v "$name" True ;;
      false|0) printf -v "$name" False ;;
      *) recipe_die "$name must be True or False (or 1/0), got '$value'" ;;
    esac
  done
  # npu_flashrl.config.lmhead_fp32_requested's spellings; anything else would stop every worker
  case "${FLASHRL_LMHEAD_FP32-0}" in
    [01]|[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]|[Yy][Ee][Ss]|[Nn][Oo]|[Oo][Nn]|[Oo][Ff][Ff]) ;;
    *) recipe_die "FLASHRL_LMHEAD_FP32 must be 1 or 0 (also true/false, yes/no, on/off), got '$FLASHRL_LMHEAD_FP32'" ;;
  esac
}

# hydra_value VALUE: VALUE as one Hydra override value that reads back as the same string. Plain
# paths and names stay as they are; anything else (non-ASCII, spaces, ( ) = # [ ] { } ~ & ' " $ \ ,
# or a word Hydra would type, such as null or 1e5) is double-quoted the way Hydra's override grammar
# takes quoted values: a backslash before each '"', backslashes doubled where they end the value or
# precede a quote, and '${' written '\${' (else OmegaConf would interpolate it).
hydra_value() {
  local s="$1" out="" run="" c i
  if [[ "$s" =~ ^[A-Za-z_/.][A-Za-z0-9_/.@%+-]*$ && ! "${s,,}" =~ ^(true|false|null|nan|inf)$ ]]; then
    printf '%s' "$s"
    return 0
  fi
  for (( i = 0; i < ${#s}; i++ )); do
    c="${s:i:1}"
    case "$c" in
      \\) run+="\\" ;;
      '"') out+="$run$run"'\"'; run="" ;;
      '$') if [[ "${s:i+1:1}" == '{' ]]; then out+="$run"'\$'; else out+="$run$c"; fi; run="" ;;
      *) out+="$run$c"; run="" ;;
    esac
  done
  printf '"%s"' "$out$run$run"
}

# hydra_str VALUE: VALUE as a Hydra single-quoted string, always (Ray's runtime env takes strings
# only: '3000', never the int 3000); escaped as hydra_value does, for "'".
hydra_str() {
  local s="$1" out="" run="" c i
  for (( i = 0; i < ${#s}; i++ )); do
    c="${s:i:1}"
    case "$c" in
      \\) run+="\\" ;;
      "'") out+="$run$run\\'"; run="" ;;
      '$') if [[ "${s:i+1:1}" == '{' ]]; then out+="$run"'\$'; else out+="$run$c"; fi; run="" ;;
      *) out+="$run$c"; run="" ;;
    esac
  done
  printf "'%s'" "$out$run$run"
}

# require_dir NAME VALUE / require_file NAME VALUE: stop with a message naming the variable and path.
require_dir() {
  [[ -n "$2" && -d "$2" ]] || recipe_die "$1 not found: '$2' (set $1=/path/to/dir)"
}
require_file() {
  [[ -n "$2" && -f "$2" ]] || recipe_die "$1 not found: '$2' (set $1=/path/to/file)"
}
require_cmd() {
  command -v "$1" >/dev/null 2>&1 || recipe_die "command '$1' not found on PATH ($2)"
}

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
  case "$RECIPE_LINE" in
    pinned) INSTALL_HINT="scripts/install_pinned.sh" ;;
    current) INSTALL_HINT="scripts/install_pinned.sh --line current" ;;
    *) recipe_die "RECIPE_LINE must be pinned or current, got '$RECIPE_LINE'" ;;
  esac
  export RECIPE_LINE
}

# ---------------------------------------------------------------------------------------------------
# flashrl_entry CONFIG_SCRIPT ARGS...: the shared body of the flash_rl/*.sh entry recipes.
#  1. preflight: model dir, data files, W8A8 checkpoint when a profile must be made, the CLI;
#  2. `npu-flashrl profile` when the profile is missing (fn int8 only);
#  3. `npu-flashrl setup` when the config is missing;
#  4. runs CONFIG_SCRIPT with FLASHRL_CONFIG exported (and --dry-run passed through).
# Environment: see the header of flash_rl/grpo_qwen25_7b_fsdp_int8_A2.sh.
flashrl_entry() {
  local config_script="$1"; shift
  parse_recipe_args "$@"
  recipe_line
  check_numeric_vars  # the ones set now: the profile and setup steps run before the config script

  MODEL_PATH="${MODEL_PATH:-$HOME/models/Qwen2.5-7B-Instruct}"
  FLASHRL_FN="${FLASHRL_FN:-int8}"
  QUANT_MODEL_PATH="${QUANT_MODEL_PATH:-${MODEL_PATH%/}-W8A8}"
  RUN_DIR="${RUN_DIR:-$HOME/npu_flashrl_runs}"
  local model_name
  model_name="$(basename "${MODEL_PATH%/}")"
  PROFILE_PATH="${PROFILE_PATH:-$RUN_DIR/profiles/$model_name.int8_profile.pt}"
  FLASHRL_CONFIG="${FLASHRL_CONFIG:-$RUN_DIR/configs/$model_name.$FLASHRL_FN.yaml}"
  NPU_FLASHRL_CLI="${NPU_FLASHRL_CLI:-npu-flashrl}"
  SETUP_EXTRA="${SETUP_EXTRA:-}"
  DATASET="${DATASET:-gsm8k}"
  DATA_DIR="${DATA_DIR:-$HOME/data/$DATASET}"
  TRAIN_FILE="${TRAIN_FILE:-$DATA_DIR/train.parquet}"
  VAL_FILE="${VAL_FILE:-$DATA_DIR/test.parquet}"
  case "$FLASHRL_FN" in
    int8|int8_profile_free) ROLLOUT_PRECISION="${ROLLOUT_PRECISION:-int8}" ;;
    bf16) ROLLOUT_PRECISION="${ROLLOUT_PRECISION:-bf16}" ;;
    *) recipe_die "FLASHRL_FN must be int8, int8_profile_free or bf16, got '$FLASHRL_FN'" ;;
  esac
  export MODEL_PATH FLASHRL_CONFIG ROLLOUT_PRECISION DATASET DATA_DIR TRAIN_FILE VAL_FILE

  # 1. preflight
  require_dir MODEL_PATH "$MODEL_PATH"
  require_file TRAIN_FILE "$TRAIN_FILE"
  require_file VAL_FILE "$VAL_FILE"
  require_file CONFIG_SCRIPT "$config_script"
  local need_profile=0 need_config=0
  [[ "$FLASHRL_FN" == int8 && ! -f "$PROFILE_PATH" ]] && need_profile=1
  [[ ! -f "$FLASHRL_CONFIG" ]] && need_config=1
  if [[ "$need_profile" == 1 ]]; then
    # The FlashRL profile compares the bf16 model with its W8A8 (compressed-tensors) checkpoint.
    require_dir QUANT_MODEL_PATH "$QUANT_MODEL_PATH"
  fi
  if [[ "$FLASHRL_FN" == int8 && "$need_config" == 1 ]]; then
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

  # 3. config (-m: the W8A8 checkpoint for int8, the bf16 checkpoint for int8_profile_free / bf16)
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
# Shared GRPO settings of the configs/*.sh launch scripts (FSDP and Megatron), so the trainer
# backends and the int8/bf16 variants differ only where they must. Variables are documented in
# configs/test_grpo_qwen25_7b_fsdp_int8_A2.sh.
grpo_defaults() {
  recipe_line
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
  check_numeric_vars  # before the arithmetic below
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
  ACTOR_OPTIMIZER_OFFLOAD="${ACTOR_OPTIMIZER_OFFLOAD:-False}"

  # pinned: sequence level as the published Ascend INT8 recipe; current: token level, the combination
  # tests/test_verl091_tis.py runs through verl 0.9.1's own driver and loss code (sequence works too).
  local tis_level_default=sequence line_suffix=""
  if [[ "$RECIPE_LINE" == current ]]; then tis_level_default=token line_suffix=_verl09; fi
  TIS_LEVEL="${TIS_LEVEL:-$tis_level_default}"
  TIS_THRESHOLD="${TIS_THRESHOLD:-2.0}"
  TIS_BATCH_NORMALIZE="${TIS_BATCH_NORMALIZE:-True}"
  # Decoupled mode: at verl 51d2104 the only combination whose truncated IS weights reach the loss
  # (bypass mode computes none; the policy-gradient switch never reaches the Ray workers). Kept as
  # variables so that the published recipe's True/True is refused with the reason (tis_preflight).
  TIS_BYPASS_MODE="${TIS_BYPASS_MODE:-False}"
  TIS_USE_POLICY_GRADIENT="${TIS_USE_POLICY_GRADIENT:-False}"  # pinned only (verl 0.7 dropped the key)
  # current only: the trainer->rollout sync buffer, one per trainer rank on the NPU (IPC) or in host
  # shared memory (old HDK/CANN); verl's default. Larger = fewer buckets, more memory.
  UPDATE_WEIGHTS_BUCKET_MB="${UPDATE_WEIGHTS_BUCKET_MB:-2048}"

  TOTAL_EPOCHS="${TOTAL_EPOCHS:-5}"
  SAVE_FREQ="${SAVE_FREQ:--1}"
  TEST_FREQ="${TEST_FREQ:-5}"
  LOGGER="${LOGGER:-console}"
  PROJECT_NAME="${PROJECT_NAME:-npu_flashrl_grpo}"
  EXPERIMENT_NAME="${EXPERIMENT_NAME:-$1_${ROLLOUT_PRECISION}_A2$line_suffix}"
  CKPT_DIR="${CKPT_DIR:-$HOME/npu_flashrl_runs/ckpts/$PROJECT_NAME/$EXPERIMENT_NAME}"
  PYTHON="${PYTHON:-python3}"

  FLASHRL_LMHEAD_FP32="${FLASHRL_LMHEAD_FP32:-1}"
  FLASHRL_LOGGING_LEVEL="${FLASHRL_LOGGING_LEVEL:-DEBUG}"
  FLASHRL_LOGGING_FILE="${FLASHRL_LOGGING_FILE:-}"
  VERL_LOGGING_LEVEL="${VERL_LOGGING_LEVEL:-DEBUG}"
  VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-DEBUG}"
  HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-3000}"
  HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-3000}"
  HCCL_HOST_SOCKET_PORT_RANGE="${HCCL_HOST_SOCKET_PORT_RANGE:-60000-60050}"
  HCCL_NPU_SOCKET_PORT_RANGE="${HCCL_NPU_SOCKET_PORT_RANGE:-61000-61050}"
}

# tis_preflight: refuse the algorithm.rollout_correction combinations that do no TIS on the recipe's
# verl (pinned: the rule of npu_flashrl.adapters.verl.check_tis at 51d2104; current: verl 0.9.1, see
# docs/verl_server_mode.md "TIS on verl 0.9.1"). Extra Hydra overrides count, last one wins.
tis_preflight() {
  local level="$TIS_LEVEL" bypass="$TIS_BYPASS_MODE" pg="$TIS_USE_POLICY_GRADIENT" a
  local loss_type=ppo_clip worker_loss_mode=vanilla worker_loss_type="" worker_level=null
  for a in "${EXTRA_ARGS[@]}"; do
    case "$a" in
      algorithm.rollout_correction.rollout_is=*|+algorithm.rollout_correction.rollout_is=*) level="${a#*=}" ;;
      algorithm.rollout_correction.bypass_mode=*|+algorithm.rollout_correction.bypass_mode=*) bypass="${a#*=}" ;;
      algorithm.rollout_correction.use_policy_gradient=*|+algorithm.rollout_correction.use_policy_gradient=*) pg="${a#*=}" ;;
      algorithm.rollout_correction.loss_type=*) loss_type="${a#*=}" ;;
      actor_rollout_ref.actor.policy_loss.loss_mode=*|+actor_rollout_ref.actor.policy_loss.loss_mode=*) worker_loss_mode="${a#*=}" ;;
      *actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=*) worker_loss_type="${a#*=}" ;;
      *actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=*) worker_level="${a#*=}" ;;
    esac
  done
  case "${bypass,,}" in true|false) ;; *) recipe_die "TIS_BYPASS_MODE (algorithm.rollout_correction.bypass_mode) must be True or False, got '$bypass'" ;; esac
  case "${pg,,}" in true|false) ;; *) recipe_die "TIS_USE_POLICY_GRADIENT (algorithm.rollout_correction.use_policy_gradient) must be True or False, got '$pg'" ;; esac
  if [[ "$RECIPE_LINE" == current ]]; then
    # the rules of npu_flashrl.adapters.verl.tis_091.problems (verl 0.9.1)
    local fix="fix: TIS_BYPASS_MODE=False (decoupled mode: verl 0.9.1's driver computes the truncated IS weights and the workers' vanilla PPO loss multiplies them in)"
    local wl=actor_rollout_ref.actor.policy_loss
    if [[ "${pg,,}" == true ]]; then
      recipe_die "TIS_USE_POLICY_GRADIENT=$pg / algorithm.rollout_correction.use_policy_gradient: verl 0.7+ has no such key (replaced by algorithm.rollout_correction.loss_type, bypass mode only); $fix"
    fi
    if [[ "${bypass,,}" == true && "$loss_type" != ppo_clip && "$loss_type" != reinforce ]]; then
      recipe_die "algorithm.rollout_correction.loss_type=$loss_type: verl 0.9.1's bypass loss takes ppo_clip or reinforce"
    fi
    if [[ "${bypass,,}" == true && "$level" != null ]]; then
      if [[ "$loss_type" == ppo_clip ]]; then
        recipe_die "algorithm.rollout_correction.bypass_mode=$bypass with rollout_is=$level and loss_type=ppo_clip: at verl 0.9.1 bypass mode with ppo_clip computes the IS weights for metrics only and leaves them out of the loss; $fix"
      elif [[ "$worker_loss_mode" != bypass_mode || "$worker_loss_type" != reinforce || "$worker_level" == null ]]; then
        recipe_die "algorithm.rollout_correction.bypass_mode=$bypass loss_type=reinforce: verl 0.9.1's apply_bypass_mode switches the loss on the DRIVER's config copy only; the Ray workers keep $wl.loss_mode=$worker_loss_mode without IS weights unless they start with $wl.loss_mode=bypass_mode +$wl.rollout_correction.loss_type=reinforce +$wl.rollout_correction.rollout_is=$level; $fix"
      fi
      recipe_log "WARNING: bypass mode + loss_type=reinforce with the workers' $wl.* set: read from verl 0.9.1's source, not run through Ray"
    fi
    if [[ "${bypass,,}" == false && "$worker_loss_mode" == bypass_mode ]]; then
      recipe_die "$wl.loss_mode=bypass_mode with algorithm.rollout_correction.bypass_mode=False: that loss ignores the batch's rollout_is_weights and takes the trainer's old_log_probs for the rollout's; $fix"
    fi
    return 0
  fi
  local fix="fix: TIS_BYPASS_MODE=False TIS_USE_POLICY_GRADIENT=False (decoupled mode: verl multiplies the truncated IS weights into the PPO loss)"
  if [[ "${pg,,}" == true ]]; then
    recipe_die "algorithm.rollout_correction.use_policy_gradient=$pg: at verl 51d2104 the policy-gradient loss switch is made on the driver's config copy only and never reaches the Ray workers, which keep PPO-clip without IS weights (verl issue #4912); $fix"
  fi
  if [[ "${bypass,,}" == true && "$level" != null ]]; then
    recipe_die "algorithm.rollout_correction.bypass_mode=$bypass with rollout_is=$level: at verl 51d2104 bypass mode computes no IS weights (ray_trainer.py skips compute_rollout_correction_and_add_to_batch), so TIS would do nothing; $fix"
  fi
}

# Cheap checks, before Ray or anything else starts.
grpo_preflight() {
  check_numeric_vars
  case "$ROLLOUT_PRECISION" in
    int8|bf16) ;;
    *) recipe_die "ROLLOUT_PRECISION must be int8 or bf16, got '$ROLLOUT_PRECISION'" ;;
  esac
  case "$TIS_LEVEL" in
    null|token|sequence) ;;
    *) recipe_die "TIS_LEVEL must be null, token or sequence (algorithm.rollout_correction.rollout_is), got '$TIS_LEVEL'" ;;
  esac
  tis_preflight
  if [[ "$RECIPE_LINE" == current ]]; then server_mode_preflight; fi
  require_dir MODEL_PATH "$MODEL_PATH"
  require_file MODEL_PATH/config.json "$MODEL_PATH/config.json"
  require_file TRAIN_FILE "$TRAIN_FILE"
  require_file VAL_FILE "$VAL_FILE"
  if [[ "$ROLLOUT_PRECISION" == int8 || -n "$FLASHRL_CONFIG" ]]; then
    if [[ "$DRY_RUN" == 1 && -n "$FLASHRL_CONFIG" && "${NPU_FLASHRL_PENDING_CONFIG:-}" == "$FLASHRL_CONFIG" ]]; then
      recipe_log "dry run: FLASHRL_CONFIG $FLASHRL_CONFIG would be created by npu-flashrl setup"
    else
      require_file FLASHRL_CONFIG "$FLASHRL_CONFIG"
    fi
  fi
  if (( ROLLOUT_TP > NPUS_PER_NODE )); then
    recipe_die "ROLLOUT_TP=$ROLLOUT_TP exceeds NPUS_PER_NODE=$NPUS_PER_NODE"
  fi
  if (( NPUS_PER_NODE % ROLLOUT_TP != 0 )); then
    recipe_die "ROLLOUT_TP=$ROLLOUT_TP must divide NPUS_PER_NODE=$NPUS_PER_NODE (each vLLM rollout replica takes ROLLOUT_TP NPUs of one node)"
  fi
  if (( TRAIN_BATCH_SIZE < PPO_MINI_BATCH_SIZE )); then
    recipe_die "TRAIN_BATCH_SIZE=$TRAIN_BATCH_SIZE is smaller than PPO_MINI_BATCH_SIZE=$PPO_MINI_BATCH_SIZE (verl needs data.train_batch_size >= actor_rollout_ref.actor.ppo_mini_batch_size)"
  fi
  if [[ "$DRY_RUN" == 0 ]]; then
    require_cmd "$PYTHON" "set PYTHON to the interpreter of the $RECIPE_LINE stack"
    verl_line_preflight
    if [[ -n "$FLASHRL_CONFIG" ]]; then
      "$PYTHON" -c 'import npu_flashrl' 2>/dev/null \
        || recipe_die "npu_flashrl is not importable by $PYTHON (run $INSTALL_HINT)"
    fi
  fi
}

# verl_line_preflight: the verl that $PYTHON imports runs the recipe's line. verl 0.7+ refuses
# rollout.mode=sync only inside the TaskRunner, after Ray started; 51d2104 has no server-mode sync.
# Decided without importing verl (the file verl 0.7.1+ sends bucketed weights from, as
# npu_flashrl.compat.verl_server_mode does).
verl_line_preflight() {
  local found
  found="$("$PYTHON" -c 'import importlib.util as u, os
s = u.find_spec("verl")
if s is None or not s.submodule_search_locations:
    print("missing")
else:
    d = list(s.submodule_search_locations)[0]
    f = os.path.join(d, "workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py")
    print("current" if os.path.isfile(f) else "pinned")' 2>/dev/null)" || found=missing
  if [[ "$found" == missing ]]; then
    recipe_die "verl is not importable by $PYTHON (run $INSTALL_HINT, or set PYTHON)"
  fi
  if [[ "$found" != "$RECIPE_LINE" ]]; then
    if [[ "$RECIPE_LINE" == current ]]; then
      recipe_die "this recipe is for verl 0.9 server mode, but $PYTHON imports a verl without it (verl 51d2104 or older: use the pinned recipe without _verl09, or install the current line: $INSTALL_HINT)"
    fi
    recipe_die "this recipe is for verl 51d2104 (rollout.mode=sync), but $PYTHON imports verl 0.7+ (server mode, which refuses sync): use the _verl09 recipe"
  fi
}

# nz_refuse WHERE VALUE: vllm-ascend 0.23's NPUWorker.wake_up (verl's sleep mode, every step) refuses
# FRACTAL_NZ weights; verl's worker extension sets VLLM_ASCEND_ENABLE_NZ=0 only when it is unset.
nz_refuse() {
  case "$2" in
    0|"") ;;
    *) recipe_die "$1: VLLM_ASCEND_ENABLE_NZ=$2 reaches verl's vLLM workers (verl sets 0 only when unset) and vllm-ascend 0.23 refuses to wake the engine from sleep mode with FRACTAL_NZ weights ('FRACTAL_NZ mode is enabled ...'); unset it or set 0" ;;
  esac
}

# server_mode_preflight (current line): what verl 0.9.1 would only report after Ray and the vLLM
# servers started, or never (docs/troubleshooting.md).
server_mode_preflight() {
  local a key value
  for a in "${EXTRA_ARGS[@]}"; do
    key="${a%%=*}"; key="${key#+}"; key="${key#+}"; value="${a#*=}"
    case "$key" in
      actor_rollout_ref.rollout.mode)
        [[ "$value" == sync ]] && recipe_die "$a: verl 0.7+ removed the sync rollout mode (RolloutConfig refuses it); server mode is the only one and npu_flashrl follows the syncs there (docs/verl_server_mode.md)" ;;
      actor_rollout_ref.rollout.quantization|actor_rollout_ref.rollout.engine_kwargs.vllm.quantization)
        if [[ -n "$FLASHRL_CONFIG" ]]; then
          case "${value,,}" in null|none|"") ;; *) recipe_die "$a next to FLASHRL_CONFIG: verl would quantize the rollout itself and npu_flashrl's INT8 rollout cannot apply as well; drop $key (or unset FLASHRL_CONFIG for verl's own)" ;; esac
        fi ;;
      ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ASCEND_ENABLE_NZ)
        nz_refuse "$a" "${value//\'/}" ;;
      actor_rollout_ref.rollout.qat.enable)
        if [[ -n "$FLASHRL_CONFIG" && "${value,,}" == true ]]; then
          recipe_die "$a next to FLASHRL_CONFIG: verl's QAT rollout quantizes the engine itself; drop $key (or unset FLASHRL_CONFIG)"
        fi ;;
    esac
  done
  if [[ -n "${VLLM_ASCEND_ENABLE_NZ:-}" ]]; then nz_refuse "VLLM_ASCEND_ENABLE_NZ in this shell" "$VLLM_ASCEND_ENABLE_NZ"; fi
  # VLLM_PLUGINS (a list) turns off every vLLM general plugin not in it; npu_flashrl reaches verl's
  # vLLM server, EngineCore and worker processes only as one (docs/verl_server_mode.md).
  if [[ -n "$FLASHRL_CONFIG" && -n "${VLLM_PLUGINS:-}" && ",${VLLM_PLUGINS// /}," != *,npu_flashrl,* ]]; then
    recipe_die "VLLM_PLUGINS='$VLLM_PLUGINS' leaves out npu_flashrl: verl's vLLM processes would build a bf16 engine; add npu_flashrl to it or unset VLLM_PLUGINS"
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

# moe_preflight (the MoE recipes, FSDP and Megatron): what verl 0.9.1 would refuse only inside
# Ray, and what npu_flashrl refuses at
# engine build, said before anything starts. Extra Hydra overrides count.
# shellcheck disable=SC2153  # ROLLOUT_TP / ROLLOUT_DP / ROLLOUT_EP: set by the MoE config scripts
moe_preflight() {
  if (( ROLLOUT_EP != 1 && ROLLOUT_EP != ROLLOUT_TP * ROLLOUT_DP )); then
    recipe_die "ROLLOUT_EP=$ROLLOUT_EP: verl 0.9.1's RolloutConfig requires actor_rollout_ref.rollout.expert_parallel_size = tensor_model_parallel_size x data_parallel_size ($ROLLOUT_TP x $ROLLOUT_DP = $((ROLLOUT_TP * ROLLOUT_DP))) for expert parallel, or 1 (experts split over the TP ranks)"
  fi
  [[ "${ROLLOUT_PRECISION:-int8}" == int8 ]] || return 0
  local a key value why
  for a in "${EXTRA_ARGS[@]}"; do
    key="${a%%=*}"; key="${key#+}"; key="${key#+}"; value="${a#*=}"; value="${value//\'/}"
    why=""
    case "$key" in
      *.dynamic_eplb|*.enable_eplb)
        case "${value,,}" in true|1) why="dynamic EPLB moves experts between ranks and slots at run time" ;; esac ;;
      *.expert_map_path)
        case "${value,,}" in null|none|"") ;; *) why="an expert map turns vllm-ascend's dynamic EPLB on" ;; esac ;;
      *.num_redundant_experts)
        [[ "$value" =~ ^0*$ ]] || why="redundant experts give a logical expert several physical copies" ;;
    esac
    if [[ -n "$why" ]]; then
      recipe_die "$a: $why, which npu_flashrl's in-place INT8 expert reload does not track (it refuses such an engine at build, docs/moe.md); drop it for INT8 rollouts"
    fi
  done
  if [[ -n "${FLASHRL_CONFIG:-}" && -f "$FLASHRL_CONFIG" ]] \
      && grep -Eq "^[[:space:]-]*fn:[[:space:]]*[\"']?int8[\"']?[[:space:]]*(#.*)?$" "$FLASHRL_CONFIG"; then
    recipe_die "FLASHRL_CONFIG $FLASHRL_CONFIG has fn: int8: FlashRL's int8 profile has no entries for MoE experts and npu_flashrl refuses it for a MoE model; use fn: int8_profile_free (npu-flashrl setup -m \$MODEL_PATH --fn int8_profile_free) or a W8A8 MoE checkpoint (docs/moe.md)"
  fi
}
