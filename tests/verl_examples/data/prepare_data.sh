#!/usr/bin/env bash
# Prepares the GRPO training data as parquet with verl's own preprocessing scripts, in the layout the
# recipes expect: $DATA_ROOT/<dataset>/train.parquet and test.parquet.
#   gsm8k: examples/data_preprocess/gsm8k.py (HF dataset openai/gsm8k; GSM8K_LOCAL_PATH for an offline copy)
#   dapo:  recipe/dapo/prepare_dapo_data.sh (DAPO-Math-17k for training, AIME-2024 as test set)
#   geo3k: examples/data_preprocess/geo3k.py (HF dataset hiyouga/geometry3k, images + questions: the
#          vision-language recipes; GEO3K_LOCAL_PATH for an offline copy)
#
# Usage: prepare_data.sh [--dry-run]
#
# Environment (defaults in brackets):
#   DATASET           gsm8k | dapo | geo3k | all (gsm8k and dapo) [gsm8k]
#   DATA_ROOT         [$HOME/data]
#   VERL_DIR          verl checkout at the pinned commit [$HOME/npu_flashrl_stack/verl] (install_pinned.sh)
#   GSM8K_LOCAL_PATH  local copy of openai/gsm8k for nodes without hub access [empty]
#   GEO3K_LOCAL_PATH  local copy of hiyouga/geometry3k (its data/*.parquet) [empty]
#   OVERWRITE         1 = regenerate existing files [0]
#   PYTHON            [python3]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
parse_recipe_args "$@"

DATASET="${DATASET:-gsm8k}"
DATA_ROOT="${DATA_ROOT:-$HOME/data}"
VERL_DIR="${VERL_DIR:-$HOME/npu_flashrl_stack/verl}"
GSM8K_LOCAL_PATH="${GSM8K_LOCAL_PATH:-}"
GEO3K_LOCAL_PATH="${GEO3K_LOCAL_PATH:-}"
OVERWRITE="${OVERWRITE:-0}"
PYTHON="${PYTHON:-python3}"

case "$OVERWRITE" in 0|1) ;; *) recipe_die "OVERWRITE must be 0 or 1, got '$OVERWRITE'" ;; esac
case "$DATASET" in
  gsm8k|dapo|geo3k) datasets=("$DATASET") ;;
  all) datasets=(gsm8k dapo) ;;  # the text recipes' data; geo3k on its own
  *) recipe_die "DATASET must be gsm8k, dapo, geo3k or all, got '$DATASET'" ;;
esac
require_dir VERL_DIR "$VERL_DIR"

done_already() { [[ "$OVERWRITE" != 1 && -f "$1/train.parquet" && -f "$1/test.parquet" ]]; }

for ds in "${datasets[@]}"; do
  out="$DATA_ROOT/$ds"
  if done_already "$out"; then
    recipe_log "$ds: $out/train.parquet and test.parquet exist (OVERWRITE=1 to regenerate)"
    continue
  fi
  case "$ds" in
    gsm8k)
      script="$VERL_DIR/examples/data_preprocess/gsm8k.py"
      require_file "VERL_DIR/examples/data_preprocess/gsm8k.py" "$script"
      cmd=("$PYTHON" "$script" --local_save_dir "$out")
      if [[ -n "$GSM8K_LOCAL_PATH" ]]; then
        require_dir GSM8K_LOCAL_PATH "$GSM8K_LOCAL_PATH"
        cmd+=(--local_dataset_path "$GSM8K_LOCAL_PATH")
      fi
      run_or_print mkdir -p "$out"
      run_or_print "${cmd[@]}"
      ;;
    dapo)
      script="$VERL_DIR/recipe/dapo/prepare_dapo_data.sh"
      require_file "VERL_DIR/recipe/dapo/prepare_dapo_data.sh" "$script"
      run_or_print mkdir -p "$out"
      run_or_print env "VERL_HOME=$DATA_ROOT" "TRAIN_FILE=$out/train.parquet" "TEST_FILE=$out/test.parquet" \
        "OVERWRITE=$OVERWRITE" bash "$script"
      ;;
    geo3k)
      script="$VERL_DIR/examples/data_preprocess/geo3k.py"
      require_file "VERL_DIR/examples/data_preprocess/geo3k.py" "$script"
      cmd=("$PYTHON" "$script" --local_dir "$out")
      if [[ -n "$GEO3K_LOCAL_PATH" ]]; then
        require_dir GEO3K_LOCAL_PATH "$GEO3K_LOCAL_PATH"
        cmd+=(--local_dataset_path "$GEO3K_LOCAL_PATH")
      fi
      run_or_print mkdir -p "$out"
      run_or_print "${cmd[@]}"
      ;;
  esac
done
recipe_log "data ready under $DATA_ROOT (DATASET=$DATASET)"
