#!/usr/bin/env bash
# Sourced by ../common.sh (not executed): the shared body of the flash_rl/*.sh entry recipes (profile,
# setup, then the launch script).
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
