#!/usr/bin/env bash
# The project's test command: for every CPU test-stack line (requirements/cpu-stack-<line>.txt) sets
# up its venv on a fresh machine (idempotent, .venvs/<line>), then runs the suite on the real vLLM /
# vllm-ascend / verl / FlashRL code of that line with emulated torch_npu. The primary line runs every
# test; the other lines run the tests marked `every_line` (the ones that touch line-specific code).
# A line whose upstream sources are missing (the pinned line needs ../shared/upstream) is skipped
# with one line. Extra arguments go to pytest (default: tests).
#
# Test modules that need an upstream package another test may have imported first in the same
# process (tests/test_verl_51d2104_*.py: verl 51d2104 from ../shared/upstream, which one process
# cannot hold beside the line's installed verl) run in a pytest process of their own per line, so
# no earlier import can turn them into skips.
#
#   NPU_FLASHRL_LINES         lines to run, in order      (default: current 0.11 pinned, those present)
#   NPU_FLASHRL_PRIMARY_LINE  the line that runs all tests (default: current)
#   NPU_FLASHRL_VENVS         where the venvs live         (default: .venvs)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINES="${NPU_FLASHRL_LINES:-current 0.11 pinned}"
PRIMARY="${NPU_FLASHRL_PRIMARY_LINE:-current}"
cd "$ROOT"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"

log() { printf '[test] %s\n' "$*" >&2; }
failed=()
ran=()
OWN_PROCESS=(tests/test_verl_51d2104_*.py)
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
  start=$SECONDS
  rc=0
  py="${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$line/bin/python"
  if [[ $# -gt 0 ]]; then
    log "line $line: pytest ${select[*]} $*"
    NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${select[@]}" "$@" || rc=$?
  else
    ignore=()
    for f in "${OWN_PROCESS[@]}"; do ignore+=(--ignore "$f"); done
    log "line $line: pytest ${select[*]} tests (${#OWN_PROCESS[@]} modules in processes of their own)"
    NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${select[@]}" "${ignore[@]}" tests || rc=$?
    for f in "${OWN_PROCESS[@]}"; do
      one=0
      NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${select[@]}" "$f" || one=$?
      # 5 = nothing collected (not every_line): not a failure
      [[ "$one" == 0 || "$one" == 5 ]] || rc=$one
    done
  fi
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
