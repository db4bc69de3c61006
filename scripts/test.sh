#!/usr/bin/env bash
# The project's test command: for every CPU test-stack line (requirements/cpu-stack-<line>.txt) sets
# up its venv on a fresh machine (idempotent, .venvs/<line>), then runs the suite on the real vLLM /
# vllm-ascend / verl / FlashRL code of that line with emulated torch_npu. The primary line runs every
# test; the other lines run the tests marked `every_line` (the ones that touch line-specific code).
# A line whose upstream sources are missing (the pinned line needs ../shared/upstream) is skipped
# with one line. Extra arguments go to pytest (default: tests).
#
#   NPU_FLASHRL_LINES         lines to run, in order      (default: pinned 0.11 current, those present)
#   NPU_FLASHRL_PRIMARY_LINE  the line that runs all tests (default: 0.11)
#   NPU_FLASHRL_VENVS         where the venvs live         (default: .venvs)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINES="${NPU_FLASHRL_LINES:-pinned 0.11 current}"
PRIMARY="${NPU_FLASHRL_PRIMARY_LINE:-0.11}"
cd "$ROOT"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"

log() { printf '[test] %s\n' "$*" >&2; }
failed=()
ran=()
for line in $LINES; do
  if [[ ! -f "requirements/cpu-stack-$line.txt" ]]; then
    log "line $line: no requirements/cpu-stack-$line.txt, skipped"
    continue
  fi
  rc=0
  bash "$ROOT/scripts/bootstrap_cpu_stack.sh" --line "$line" || rc=$?
  if [[ "$rc" == 3 ]]; then
    log "line $line skipped: its upstream sources are not here (see above)"
    continue
  elif [[ "$rc" != 0 ]]; then
    log "line $line: setting up its venv failed (exit $rc)"
    failed+=("$line"); continue
  fi
  select=()
  [[ "$line" == "$PRIMARY" ]] || select=(-m every_line)
  log "line $line: pytest ${select[*]} ${*:-tests}"
  start=$SECONDS
  rc=0
  NPU_FLASHRL_STACK_LINE="$line" "${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$line/bin/python" -m pytest -q \
    -p no:cacheprovider "${select[@]}" "${@:-tests}" || rc=$?
  # 5 = nothing collected: a selection without every_line tests is not a failure of that line
  if [[ "$rc" == 0 || ( "$rc" == 5 && "$line" != "$PRIMARY" ) ]]; then
    ran+=("$line ($((SECONDS - start)) s)")
  else
    failed+=("$line")
  fi
done
log "lines passed: ${ran[*]:-none}"
if [[ ${#failed[@]} -gt 0 ]]; then
  log "lines FAILED: ${failed[*]}"
  exit 1
fi
[[ ${#ran[@]} -gt 0 ]] || { log "no line ran"; exit 1; }
