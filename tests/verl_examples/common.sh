#!/usr/bin/env bash
# Helpers shared by the npu_flashrl verl recipes (sourced, not executed).
# Every recipe: `set -euo pipefail`, tunables as env vars with defaults, `--dry-run` prints the full
# command without launching anything, preflight checks stop before anything expensive starts.

DRY_RUN="${DRY_RUN:-0}"
EXTRA_ARGS=()

recipe_log() { printf '[%s] %s\n' "$(basename "$0" .sh)" "$*" >&2; }
recipe_die() { printf '[%s] ERROR: %s\n' "$(basename "$0" .sh)" "$*" >&2; exit 1; }

# parse_recipe_args "$@": --dry-run / -n, --help / -h (prints the header comment); anything else is
# kept in EXTRA_ARGS and appended to the verl command (extra Hydra overrides).
parse_recipe_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --dry-run|-n) DRY_RUN=1 ;;
      -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
      *) EXTRA_ARGS+=("$1") ;;
    esac
    shift
  done
  export DRY_RUN
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

# print_cmd ARGS...: one shell-quoted command, ready to copy-paste; every KEY=VALUE word (environment
# assignment or Hydra override) starts a continued line of its own.
print_cmd() {
  local first=1 a
  for a in "$@"; do
    if [[ "$first" == 1 ]]; then
      printf '%q' "$a"; first=0
    elif [[ "$a" =~ ^[+~]?[A-Za-z_][A-Za-z0-9_.]*= ]]; then
      printf ' \\\n    %q' "$a"
    else
      printf ' %q' "$a"
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
# flashrl_entry CONFIG_SCRIPT ARGS...: the shared body of the flash_rl/*.sh entry recipes.
#  1. preflight: model dir, data files, W8A8 checkpoint when a profile must be made, the CLI;
#  2. `npu-flashrl profile` when the profile is missing (fn int8 only);
#  3. `npu-flashrl setup` when the config is missing;
#  4. runs CONFIG_SCRIPT with FLASHRL_CONFIG exported (and --dry-run passed through).
# Environment: see the header of flash_rl/grpo_qwen25_7b_fsdp_int8_A2.sh.
flashrl_entry() {
  local config_script="$1"; shift
  parse_recipe_args "$@"

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
    require_cmd "$NPU_FLASHRL_CLI" "install npu_flashrl (scripts/install_pinned.sh) or set NPU_FLASHRL_CLI"
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
