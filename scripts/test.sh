#!/usr/bin/env bash
# The project's test command: for every CPU test-stack line (requirements/cpu-stack-<line>.txt) sets
# up its venv on a fresh machine (idempotent, .venvs/<line>), then runs the suite on the real vLLM /
# vllm-ascend / verl / FlashRL code of that line with emulated torch_npu. The primary line runs every
# test; the other lines run the tests marked `every_line` (the ones that touch line-specific code).
# A line whose upstream sources are missing (the pinned line needs ../shared/upstream) is skipped
# with one line. Extra arguments go to pytest (default: tests).
#
# Tests live in folders that mirror the package (tests/kernels, tests/adapters/vllm_ascend, ...;
# tests/support holds shared helpers). Test modules that need an upstream package another test may
# have imported first in the same process (tests/adapters/verl/own_process/: verl 51d2104 from
# ../shared/upstream, which one process cannot hold beside the line's installed verl) run in a
# pytest process of their own per line, so no earlier import can turn them into skips.
#
#   NPU_FLASHRL_LINES         lines to run, in order      (default: current 0.11 pinned, those present)
#   NPU_FLASHRL_PRIMARY_LINE  the line that runs all tests (default: current)
#   NPU_FLASHRL_VENVS         where the venvs live         (default: .venvs)
#   NPU_FLASHRL_TEST_JOBS     pytest processes at a time, 1 or 2 (default: 2 with two or more CPUs).
#                             With 2, the primary line's suite is split in two shards (the folders
#                             in PRIMARY_SHARD_A, and the rest) and two workers take the jobs (the shards,
#                             the other lines' suites, the own-process modules) longest first; each
#                             job's output is printed when all are done. Each job is mostly one
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
shopt -s nullglob  # a test-file pattern that matches nothing is no file
failed=()
ran=()
ready=()
OWN_PROCESS=(tests/adapters/verl/own_process/test_*.py)
# The primary line's first shard (JOBS=2), by folder: the tests that run whole rehearsals or
# benchmarks (they share the session's pre-trained tiny model, so they stay in one process) and the
# per-architecture model tests. Every other folder goes to the second shard.
PRIMARY_SHARD_A=(tests/rehearsal tests/benchmarks tests/models)

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

# 2. the jobs: one pytest process each (line, name, must-collect, arguments)
JOB_LINE=(); JOB_NAME=(); JOB_MUST=(); JOB_ARGS=()
add_job() { JOB_LINE+=("$1"); JOB_NAME+=("$2"); JOB_MUST+=("$3"); shift 3; JOB_ARGS+=("$*"); }
ignore=()
for f in "${OWN_PROCESS[@]}"; do ignore+=(--ignore "$f"); done
for line in "${ready[@]}"; do
  if [[ $# -gt 0 ]]; then
    if [[ "$line" == "$PRIMARY" ]]; then add_job "$line" "args" 1 USER_ARGS
    else add_job "$line" "args" 0 -m every_line USER_ARGS; fi
  elif [[ "$line" == "$PRIMARY" && "$JOBS" == 2 ]]; then
    shard_b=("${ignore[@]}")
    for d in "${PRIMARY_SHARD_A[@]}"; do shard_b+=(--ignore "$d"); done
    add_job "$line" "shard a" 1 "${PRIMARY_SHARD_A[@]}"
    add_job "$line" "shard b" 1 "${shard_b[@]}" tests
  elif [[ "$line" == "$PRIMARY" ]]; then
    add_job "$line" "suite" 1 "${ignore[@]}" tests
  else
    add_job "$line" "suite" 0 -m every_line "${ignore[@]}" tests
  fi
done
if [[ $# -eq 0 ]]; then
  for line in "${ready[@]}"; do
    for f in "${OWN_PROCESS[@]}"; do
      if [[ "$line" == "$PRIMARY" ]]; then add_job "$line" "$(basename "$f")" 0 "$f"
      else add_job "$line" "$(basename "$f")" 0 -m every_line "$f"; fi
    done
  done
fi

LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
run_job() {
  local i="$1" line="${JOB_LINE[$1]}" start=$SECONDS rc=0 args
  local py="${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$line/bin/python"
  read -r -a args <<<"${JOB_ARGS[$i]}"  # test paths and flags: no spaces in them
  if [[ "${args[-1]}" == USER_ARGS ]]; then  # the command line's own arguments, kept as given
    unset 'args[-1]'
    args+=("${USER_ARGS[@]}")
  fi
  log "line $line, ${JOB_NAME[$i]}: pytest ${args[*]}"
  NPU_FLASHRL_STACK_LINE="$line" "$py" -m pytest -q -p no:cacheprovider "${args[@]}" || rc=$?
  echo "$((SECONDS - start))" >"$LOGS/$i.seconds"
  # 5 = nothing collected: a failure only where the job must collect tests (the primary line)
  if [[ "$rc" == 0 || ( "$rc" == 5 && "${JOB_MUST[$i]}" == 0 ) ]]; then : >"$LOGS/$i.ok"; fi
}
worker() {  # takes the next unclaimed job until none is left (mkdir: an atomic claim)
  local i
  for i in "${!JOB_LINE[@]}"; do
    mkdir "$LOGS/claim.$i" 2>/dev/null || continue
    if [[ "$JOBS" == 1 ]]; then
      run_job "$i"
    else
      run_job "$i" >"$LOGS/$i.log" 2>&1
      log "done: line ${JOB_LINE[$i]}, ${JOB_NAME[$i]} ($(cat "$LOGS/$i.seconds") s, $([[ -f "$LOGS/$i.ok" ]] && echo passed || echo FAILED))"
    fi
  done
}
USER_ARGS=("$@")
if [[ "$JOBS" == 2 ]]; then
  log "${#JOB_LINE[@]} pytest jobs on 2 workers; each job's output follows when all are done"
  worker &
  w1=$!
  worker
  wait "$w1" || true
  for i in "${!JOB_LINE[@]}"; do
    log "----- line ${JOB_LINE[$i]}, ${JOB_NAME[$i]} -----"
    cat "$LOGS/$i.log" >&2 2>/dev/null || log "(no output)"
  done
else
  worker
fi

# 3. a line passed when every job of it did
for line in "${ready[@]}"; do
  ok=1 secs=0
  for i in "${!JOB_LINE[@]}"; do
    [[ "${JOB_LINE[$i]}" == "$line" ]] || continue
    [[ -f "$LOGS/$i.ok" ]] || ok=0
    secs=$((secs + $(cat "$LOGS/$i.seconds" 2>/dev/null || echo 0)))
  done
  if [[ "$ok" == 1 ]]; then ran+=("$line (${secs} s of pytest)"); else failed+=("$line"); fi
done
log "lines passed: ${ran[*]:-none}"
if [[ ${#failed[@]} -gt 0 ]]; then
  log "lines FAILED: ${failed[*]}"
  exit 1
fi
[[ ${#ran[@]} -gt 0 ]] || { log "no line ran"; exit 1; }
