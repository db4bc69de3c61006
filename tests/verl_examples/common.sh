#!/usr/bin/env bash
# shellcheck disable=SC2034  # the variables and arrays set here are used by the scripts that source this file
# Helpers shared by the npu_flashrl verl recipes (sourced, not executed): here the arguments, the
# messages, the preflight call, the input checks and the stack line; by concern in lib/ (sourced at
# the end of this file) command quoting and printing, the entry recipes' body and the GRPO launch.
# Every rule about the values (types and ranges of the variables, the layout, the TIS /
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
# shellcheck disable=SC2120  # the calls with arguments are in lib/ (shellcheck does not follow a sourced file's sources)
recipe_vars() { run_preflight vars "$@"; }
# recipe_preflight COMMAND...: the assembled verl command (and, on a real run, the installed verl).
recipe_preflight() { run_preflight launch -- "$@"; }

# recipe_sets NAME VALUE: this recipe runs with NAME=VALUE (exported). A different value the user
# (or a calling script) set is refused naming both: a recipe never replaces the user's word.
recipe_sets() {
  local current="${!1-}"
  if [[ -n "$current" && "$current" != "$2" ]]; then
    recipe_die "$1=$current is set, but this recipe runs with $1=$2: unset $1, or run the recipe for $1=$current"
  fi
  export "$1=$2"
}
# require_dir NAME VALUE / require_file NAME VALUE: stop with a message naming the variable and path.
require_dir() { [[ -n "$2" && -d "$2" ]] || recipe_die "$1 not found: '$2' (set $1=/path/to/dir)"; }
require_file() { [[ -n "$2" && -f "$2" ]] || recipe_die "$1 not found: '$2' (set $1=/path/to/file)"; }
require_cmd() { command -v "$1" >/dev/null 2>&1 || recipe_die "command '$1' not found on PATH ($2)"; }

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

# The rest, by concern (sourced from here; the functions call each other only when a recipe runs):
_RECIPE_LIB="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib"
# shellcheck source=SCRIPTDIR/lib/command.sh
source "$_RECIPE_LIB/command.sh"      # hydra_value / hydra_str, shell_word, print_cmd, run_or_print
# shellcheck source=SCRIPTDIR/lib/entry.sh
source "$_RECIPE_LIB/entry.sh"        # flash_rl/*.sh: flashrl_entry, flashrl_baseline_entry
# shellcheck source=SCRIPTDIR/lib/grpo_launch.sh
source "$_RECIPE_LIB/grpo_launch.sh"  # configs/*.sh: grpo_defaults, grpo_inputs, grpo_worker_env, grpo_shared_overrides
