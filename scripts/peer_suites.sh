#!/usr/bin/env bash
# Upstream's own test suites as the spec: runs a named selection of vllm-ascend's tests/ut and
# verl's CPU tests (the releases of the current stack line, from their registry sdists) twice on
# this stack, without and with npu_flashrl activated, the emulated torch_npu installed the same way
# in both (after upstream's conftest, as it expects), and prints every test whose outcome differs,
# with its cause. What a user's CI can run; docs/compatibility.md.
#
# Usage: scripts/peer_suites.sh [--selection small|full] [--suite vllm-ascend|verl]... [--dry-run]
#   --selection NAME  the named selection (npu_flashrl/sim/peer_suites.py SELECTIONS; default
#                     $PEER_SELECTION or small: a few minutes, run by our CI)
#   --suite NAME      only this suite (repeatable; default both)
#   --dry-run         print what would be fetched and run; fetch, run and write nothing
# Env: PEER_PYTHON (default $NPU_FLASHRL_VENVS/current/bin/python, NPU_FLASHRL_VENVS default
# <repo>/.venvs), PEER_CACHE (sdists, sources and reports; default <repo>/.cache/peer_suites),
# PEER_FLASHRL_CONFIG (the activated run's config, default int8_profile_free),
# PEER_LMHEAD_FP32 (default 1), PEER_TIMEOUT (seconds per pytest run, default 1800),
# SOC_VERSION (vllm-ascend's sdist metadata needs a chip name on a host without npu-smi; default
# ascend910b1; nothing is compiled).
# Exit: 0 no test differs, 1 some differ (listed), 2 usage, 3 the sdists cannot be fetched.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELECTION="${PEER_SELECTION:-small}"
SUITES=()
DRY_RUN=0
PYTHON="${PEER_PYTHON:-${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/current/bin/python}"
CACHE="${PEER_CACHE:-$ROOT/.cache/peer_suites}"
CONFIG="${PEER_FLASHRL_CONFIG:-int8_profile_free}"
LMHEAD_FP32="${PEER_LMHEAD_FP32:-1}"
TIMEOUT="${PEER_TIMEOUT:-1800}"
SOC="${SOC_VERSION:-ascend910b1}"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --selection) [[ $# -ge 2 ]] || { echo "peer_suites.sh: --selection needs a value" >&2; exit 2; }
                 SELECTION="$2"; shift ;;
    --selection=*) SELECTION="${1#--selection=}" ;;
    --suite) [[ $# -ge 2 ]] || { echo "peer_suites.sh: --suite needs a value" >&2; exit 2; }
             SUITES+=("$2"); shift ;;
    --suite=*) SUITES+=("${1#--suite=}") ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "peer_suites.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ ${#SUITES[@]} -gt 0 ]] || SUITES=(vllm-ascend verl)
[[ -x "$PYTHON" ]] || { echo "peer_suites.sh: no python at $PYTHON (set PEER_PYTHON or NPU_FLASHRL_VENVS)" >&2; exit 2; }
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || { echo "peer_suites.sh: PEER_TIMEOUT='$TIMEOUT': expected seconds" >&2; exit 2; }

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 VLLM_PLUGINS=none
# The releases come from the current line (npu_flashrl/lines), never typed here.
read -r VA_VERSION VERL_VERSION < <("$PYTHON" -c \
  'from npu_flashrl import lines; ln = lines.by_label("current"); print(ln.vllm_ascend, ln.verl)')

declare -A DIST=([vllm-ascend]="vllm-ascend==$VA_VERSION" [verl]="verl==$VERL_VERSION")
declare -A TARBALL=([vllm-ascend]="vllm_ascend-$VA_VERSION" [verl]="verl-$VERL_VERSION")
declare -A MEMBERS=([vllm-ascend]="tests/__init__.py tests/ut" [verl]="tests")
for suite in "${SUITES[@]}"; do
  [[ -n "${DIST[$suite]:-}" ]] || { echo "peer_suites.sh: unknown suite '$suite' (known: vllm-ascend verl)" >&2; exit 2; }
  # the selection's paths (refuses an unknown selection by name)
  "$PYTHON" -m npu_flashrl.sim.peer_suites paths "$SELECTION:$suite" >/dev/null || exit 2
done

status=0
for suite in "${SUITES[@]}"; do
  name="${TARBALL[$suite]}"
  sdist="$CACHE/sdists/$name.tar.gz"
  src="$CACHE/src/$name"
  mapfile -t paths < <("$PYTHON" -m npu_flashrl.sim.peer_suites paths "$SELECTION:$suite")
  if [[ "$DRY_RUN" == 1 ]]; then
    if [[ -f "$sdist" ]]; then
      echo "have $sdist"
    else
      echo "would fetch: SOC_VERSION=$SOC $PYTHON -m pip download --no-deps --no-binary :all: --no-build-isolation -d $CACHE/sdists ${DIST[$suite]}"
    fi
    echo "would run ($suite, $SELECTION) in $src, without then with activation (FLASHRL_CONFIG=$CONFIG FLASHRL_LMHEAD_FP32=$LMHEAD_FP32): pytest ${paths[*]}"
    continue
  fi
  if [[ ! -f "$sdist" ]]; then
    mkdir -p "$CACHE/sdists"
    if ! SOC_VERSION="$SOC" COMPILE_CUSTOM_KERNELS=0 "$PYTHON" -m pip download --quiet --no-deps \
        --no-binary :all: --no-build-isolation -d "$CACHE/sdists" "${DIST[$suite]}" >&2 || [[ ! -f "$sdist" ]]; then
      echo "peer_suites.sh: cannot fetch the ${DIST[$suite]} sdist into $CACHE/sdists (offline?)" >&2
      exit 3
    fi
  fi
  if [[ ! -d "$src/tests" ]]; then
    mkdir -p "$CACHE/src"
    read -r -a members <<<"${MEMBERS[$suite]}"
    tar -xzf "$sdist" -C "$CACHE/src" "${members[@]/#/$name/}"
  fi
  mkdir -p "$CACHE/reports"
  for mode in without with; do
    report="$CACHE/reports/$suite-$SELECTION-$mode.json"
    rm -f "$report"
    envs=(NPU_FLASHRL_PEER_EMULATION=1 NPU_FLASHRL_PEER_REPORT="$report" NPU_FLASHRL_NO_AUTOACTIVATE=1
          PYTHONPATH="$src:$PYTHONPATH")
    if [[ "$mode" == with ]]; then
      envs+=(NPU_FLASHRL_PEER_ACTIVATE=1 FLASHRL_CONFIG="$CONFIG" FLASHRL_LMHEAD_FP32="$LMHEAD_FP32")
    fi
    echo "== $suite ($SELECTION) $mode activation" >&2
    rc=0
    (cd "$src" && env -u FLASHRL_CONFIG -u FLASHRL_LMHEAD_FP32 "${envs[@]}" timeout "$TIMEOUT" \
      "$PYTHON" -m pytest -q -p no:cacheprovider -p npu_flashrl.sim.peer_suites --rootdir=. \
      --continue-on-collection-errors "${paths[@]}" >"$CACHE/reports/$suite-$SELECTION-$mode.log" 2>&1) || rc=$?
    # 0 all passed, 1 some failed: both are outcomes to compare; anything else is a broken run
    if [[ "$rc" -gt 1 ]]; then
      echo "peer_suites.sh: the $suite run $mode activation ended with $rc; see $CACHE/reports/$suite-$SELECTION-$mode.log" >&2
      tail -n 20 "$CACHE/reports/$suite-$SELECTION-$mode.log" >&2
      exit 1
    fi
  done
  echo "== $suite ($SELECTION): outcomes that differ with activation"
  "$PYTHON" -m npu_flashrl.sim.peer_suites compare "$CACHE/reports/$suite-$SELECTION-without.json" \
    "$CACHE/reports/$suite-$SELECTION-with.json" || status=1
done
if [[ "$DRY_RUN" == 1 ]]; then
  echo "dry run: nothing was fetched, run or written"
fi
exit "$status"
