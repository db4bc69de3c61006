#!/usr/bin/env bash
# The project's main job on an embedded default: sets up the CPU stack of one line (idempotent,
# scripts/bootstrap_cpu_stack.sh), then runs the CPU rehearsal of the INT8 rollout pipeline
# (`npu-flashrl rehearse`) in that line's venv.
#
# Usage: scripts/run.sh [--line NAME] [--dry-run] [REHEARSE ARGS...]
#   --line NAME  stack line (default $NPU_FLASHRL_LINE or current): current = vLLM / vllm-ascend 0.23
#                + verl 0.9.1, the syncs through verl's real bucketed sender and receiver; pinned /
#                0.11 = verl sync mode, the in-process load_weights push (rehearse --transport auto)
#   --dry-run    print the bootstrap's plan and the rehearse command, run and write nothing
# Other arguments go to `npu-flashrl rehearse` (it refuses unknown ones; `--transport` overrides the
# line's default). Env: NPU_FLASHRL_VENVS (default <repo>/.venvs), NPU_FLASHRL_MAIN_JOB (default
# rehearse), VLLM_PLUGINS (default none).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINE="${NPU_FLASHRL_LINE:-current}"
DRY_RUN=0
PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --line) [[ $# -ge 2 ]] || { echo "--line needs a value" >&2; exit 2; }; LINE="$2"; shift ;;
    --line=*) LINE="${1#--line=}" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) PASS+=("$1") ;;
  esac
  shift
done
BOOT=(bash "$ROOT/scripts/bootstrap_cpu_stack.sh" --line "$LINE")
CMD=("${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$LINE/bin/npu-flashrl" "${NPU_FLASHRL_MAIN_JOB:-rehearse}" "${PASS[@]}")
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"
if [[ "$DRY_RUN" == 1 ]]; then
  "${BOOT[@]}" --dry-run  # its plan; it writes nothing either
  printf -v shown ' %q' "${CMD[@]}"
  echo "would run: TORCH_DEVICE_BACKEND_AUTOLOAD=$TORCH_DEVICE_BACKEND_AUTOLOAD VLLM_PLUGINS=$VLLM_PLUGINS${shown}"
  echo "dry run: nothing was run or written"
  exit 0
fi
"${BOOT[@]}"
exec "${CMD[@]}"
