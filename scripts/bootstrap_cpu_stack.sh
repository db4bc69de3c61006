#!/usr/bin/env bash
# Creates .venvs/<line> and installs one CPU test stack line: the real vLLM, vllm-ascend, verl and
# FlashRL Python code, runnable on a machine without an NPU (npu_flashrl emulates torch_npu).
#
# Usage: scripts/bootstrap_cpu_stack.sh [--line NAME] [--dry-run]
#   NAME: a requirements/cpu-stack-NAME.txt (pinned, 0.11, current); default $NPU_FLASHRL_LINE or 0.11.
# Idempotent: a stamp holding the hash of the pins and of this script makes a second run a no-op.
# Exit 3 (and one line saying why) when the line's [sources] trees are not there (a user's clone has
# no ../shared/upstream): callers skip the line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINE="${NPU_FLASHRL_LINE:-0.11}"
PYTHON="${PYTHON:-python3}"
PIP_FLAGS="${PIP_FLAGS:---quiet --disable-pip-version-check}"
DRY_RUN=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --line) [[ $# -ge 2 ]] || { echo "--line needs a value" >&2; exit 2; }; LINE="$2"; shift ;;
    --line=*) LINE="${1#--line=}" ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
REQS="${NPU_FLASHRL_CPU_REQS:-$ROOT/requirements/cpu-stack-$LINE.txt}"
VENV="${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$LINE"
CACHE="${NPU_FLASHRL_CACHE:-$ROOT/.cache/bootstrap}"

log() { printf '[bootstrap %s] %s\n' "$LINE" "$*" >&2; }
run() {
  log "+ $*"
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}

if [[ ! -f "$REQS" ]]; then
  known=""
  for f in "$ROOT"/requirements/cpu-stack-*.txt; do
    [[ -e "$f" ]] && { f="${f##*/cpu-stack-}"; known+="${f%.txt} "; }
  done
  log "unknown line '$LINE': no $REQS (known lines: ${known:-none})"
  exit 2
fi

# Packages (or paths) of one "# [section]" block of the pins file.
section() {
  awk -v want="$1" '
    /^# \[/ { match($0, /\[[^]]+\]/); cur = substr($0, RSTART + 1, RLENGTH - 2); next }
    /^[[:space:]]*(#|$)/ { next }
    cur == want { print $1 }
  ' "$REQS"
}

# Source trees of lines without a registry release: all present, or the line is skipped.
mapfile -t sources < <(section sources)
abs_sources=()
for src in "${sources[@]}"; do
  abs="$(cd "$ROOT" && cd "$src" 2>/dev/null && pwd || true)"
  if [[ -z "$abs" ]]; then
    log "line '$LINE' unavailable: source tree $src not found (relative to $ROOT; see ${REQS#"$ROOT"/})"
    exit 3
  fi
  abs_sources+=("$abs")
done

"$PYTHON" - <<'PY' || { log "Python >= 3.10 is required (PYTHON=$PYTHON)"; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY

# Optional overlay of the line (requirements/cpu-stack-<line>-megatron.txt): installed with
# --no-deps into <venv>/megatron-overlay, which is not on the venv's sys.path (tests add it to the
# processes that need it).
OVERLAY_REQS="${REQS%.txt}-megatron.txt"
overlay_pins=()
if [[ -f "$OVERLAY_REQS" ]]; then
  mapfile -t overlay_pins < <(awk '/^[[:space:]]*(#|$)/ { next } { print $1 }' "$OVERLAY_REQS")
fi

stamp_want="$( (cat "$REQS" "${BASH_SOURCE[0]}" "$ROOT/setup.py"; printf '%s\n' "${overlay_pins[@]}" "${abs_sources[@]}") | sha256sum | cut -d' ' -f1)"
stamp_file="$VENV/.npu_flashrl_stack"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_want" ]]; then
  log "CPU stack already installed in $VENV (pins unchanged)"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || run "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# shellcheck disable=SC2206  # PIP_FLAGS is a list of flags on purpose
PIP=("$PY" -m pip $PIP_FLAGS)
[[ "$DRY_RUN" == 1 ]] || mkdir -p "$CACHE"  # a dry run writes nothing

# torch first and pinned for every later step: a second torch would be a CUDA build of several GB.
mapfile -t torch_pin < <(section torch)
constraints="$CACHE/constraints-$LINE.txt"
if [[ "$DRY_RUN" == 0 ]]; then printf '%s\n' "${torch_pin[@]}" > "$constraints"
else log "would write $constraints: ${torch_pin[*]}"; fi
run "${PIP[@]}" install -c "$constraints" "${torch_pin[@]}"

mapfile -t build_pkgs < <(section build)
[[ ${#build_pkgs[@]} -eq 0 ]] || run "${PIP[@]}" install -c "$constraints" "${build_pkgs[@]}"

mapfile -t deps < <(section deps)
run "${PIP[@]}" install -c "$constraints" "${deps[@]}"

# vLLM from its sdist with the empty target: the binary wheels are CUDA builds. cargo is taken off
# PATH for the build so optional Rust extensions (vLLM 0.23's vllm-rs) are skipped.
no_cargo_path="$(printf '%s' "$PATH" | tr ':' '\n' | grep -v -e cargo -e '\.rustup' | paste -sd: -)"
mapfile -t sdists < <(section sdist-empty)
for spec in "${sdists[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  if "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$name').split('+')[0] == '$version' else 1)" 2>/dev/null; then
    log "$spec already installed"
    continue
  fi
  tarball="$CACHE/$name-$version.tar.gz"
  # VLLM_VERSION_OVERRIDE: without it vLLM 0.23's metadata says 0.23.0+cpu (0.23.0+empty with the
  # empty target) and pip discards the sdist as inconsistent with the pin; older setup.py ignore it.
  [[ -f "$tarball" ]] || run env -u VLLM_TARGET_DEVICE VLLM_VERSION_OVERRIDE="$version" "${PIP[@]}" download --no-deps --no-build-isolation --no-binary "$name" -d "$CACHE" "$spec"
  run env PATH="$no_cargo_path" VLLM_TARGET_DEVICE=empty "${PIP[@]}" install --no-deps --no-build-isolation "$tarball"
done

mapfile -t nodeps < <(section nodeps)
[[ ${#nodeps[@]} -eq 0 ]] || run "${PIP[@]}" install --no-deps -c "$constraints" "${nodeps[@]}"

if [[ ${#overlay_pins[@]} -gt 0 ]]; then
  run "${PIP[@]}" install --no-deps --upgrade --target "$VENV/megatron-overlay" "${overlay_pins[@]}"
fi

# The project itself, editable, without re-resolving its (already present) dependencies.
run "${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

if [[ "$DRY_RUN" == 0 ]]; then
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  pth="$site/npu_flashrl_upstream_sources.pth"
  if [[ ${#abs_sources[@]} -gt 0 ]]; then
    # Read-only upstream trees, first on sys.path in every process of this venv (not copied).
    printf 'import sys; sys.path[:0] = [p for p in %s if p not in sys.path]\n' \
      "$("$PY" -c 'import sys, json; print(json.dumps(sys.argv[1:]))' "${abs_sources[@]}")" > "$pth"
  else
    rm -f "$pth"
  fi
  # the installed torch is the pinned one (a second resolver pass must not have replaced it)
  torch_want="$(printf '%s\n' "${torch_pin[@]}" | sed -n 's/^torch==//p')"
  "$PY" -c "import sys, torch; assert torch.__version__.split('+')[0] == sys.argv[1], (torch.__version__, sys.argv[1])" "$torch_want"
  echo "$stamp_want" > "$stamp_file"
fi
if [[ "$DRY_RUN" == 0 ]]; then log "CPU stack ready in $VENV"
else log "dry run: nothing was changed; a real run installs the CPU stack above into $VENV"; fi
