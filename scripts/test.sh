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
#   NPU_FLASHRL_TEST_JOBS     1: lines one after another; 2: the primary line beside the others,
#                             which run one after another, each into its own log printed after it
#                             (default: 2 with two or more CPUs, else 1). Each suite is mostly one
#                             single-threaded Python process, so two cores halve the wall time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINES="${NPU_FLASHRL_LINES:-current 0.11 pinned}"
PRIMARY="${NPU_FLASHRL_PRIMARY_LINE:-current}"
JOBS="${NPU_FLASHRL_TEST_JOBS:-$( (( $(nproc 2>/dev/null || echo 1) >= 2 )) && echo 2 || echo 1)}"
[[ "$JOBS" == 1 || "$JOBS" == 2 ]] || { echo "NPU_FLASHRL_TEST_JOBS=$JOBS: expected 1 or 2" >&2; exit 2; }
cd "$ROOT"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"

log() { printf '[test] %s\n' "$*" >&2; }
failed=()
ran=()
ready=()
OWN_PROCESS=(tests/test_verl_51d2104_*.py)

# 1. every line's venv, one after another (pip and the vLLM build want both cores)
for line in $LINES; do
  if [[ ! -f "requirements/cpu-stack-$line.txt" ]]; then
    log "line $line: no requirements/cpu-stack-$line.txt, skipped"
    continue
  fi
  rc=0
  bash "$ROOT/scripts/bootstrap_cpu_stack.sh" --line "$line" || rc=$?
  if [[ "$rc" == 3 ]]; then
    log "line $line skipped: its upstream sources are not here (see above)"
  elif [[ "$rc" != 0 ]]; then
    log "line $line: setting up its venv failed (exit $rc)"
    failed+=("$line")
  else
    ready+=("$line")
  fi
done

# 2. one line's suite; its exit status 0 = passed. Prints "<seconds>" on fd 3.
run_line() {
  local line="$1"; shift
  local marker=() rc=0 one start=$SECONDS
  [[ "$line" == "$PRIMARY" ]] || marker=(-m every_line)
  local py="${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$line/bin/python"
  if [[ $# -gt 0 ]]; then
    log "line $line: pytest ${marker[*]} $*"
    NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${marker[@]}" "$@" || rc=$?
  else
    local ignore=() f
    for f in "${OWN_PROCESS[@]}"; do ignore+=(--ignore "$f"); done
    log "line $line: pytest ${marker[*]} tests (${#OWN_PROCESS[@]} modules in processes of their own)"
    NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${marker[@]}" "${ignore[@]}" tests || rc=$?
    for f in "${OWN_PROCESS[@]}"; do
      one=0
      NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${marker[@]}" "$f" || one=$?
      # 5 = nothing collected (not every_line): not a failure
      [[ "$one" == 0 || "$one" == 5 ]] || rc=$one
    done
  fi
  echo "$((SECONDS - start))" >&3
  # 5 = nothing collected: a selection without every_line tests is not a failure of that line
  [[ "$rc" == 0 || ( "$rc" == 5 && "$line" != "$PRIMARY" ) ]]
}

# 3. the suites: with two jobs, the primary line in the foreground and the others, one after
# another, in the background (their output goes to a log each and is printed afterwards)
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
others=()
for line in "${ready[@]}"; do
  [[ "$JOBS" == 2 && "$line" != "$PRIMARY" ]] && others+=("$line")
done
run_others() {
  local line
  for line in "${others[@]}"; do
    if run_line "$line" "$@" 3>"$LOGS/$line.seconds" >"$LOGS/$line.log" 2>&1; then
      : >"$LOGS/$line.ok"
    fi
  done
}
bg=""
if [[ ${#others[@]} -gt 0 ]]; then
  log "lines ${others[*]} run beside line $PRIMARY (NPU_FLASHRL_TEST_JOBS=2); their output follows at the end"
  run_others "$@" &
  bg=$!
fi
for line in "${ready[@]}"; do
  [[ " ${others[*]} " == *" $line "* ]] && continue
  if run_line "$line" "$@" 3>"$LOGS/$line.seconds"; then
    ran+=("$line ($(cat "$LOGS/$line.seconds") s)")
  else
    failed+=("$line")
  fi
done
if [[ -n "$bg" ]]; then
  wait "$bg" || true
  for line in "${others[@]}"; do
    log "----- line $line (ran beside line $PRIMARY) -----"
    cat "$LOGS/$line.log" >&2 || true
    if [[ -f "$LOGS/$line.ok" ]]; then
      ran+=("$line ($(cat "$LOGS/$line.seconds" 2>/dev/null || echo ?) s)")
    else
      failed+=("$line")
    fi
  done
fi
log "lines passed: ${ran[*]:-none}"
if [[ ${#failed[@]} -gt 0 ]]; then
  log "lines FAILED: ${failed[*]}"
  exit 1
fi
[[ ${#ran[@]} -gt 0 ]] || { log "no line ran"; exit 1; }
