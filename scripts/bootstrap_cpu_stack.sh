#!/usr/bin/env bash
# Creates .venv and installs the CPU test stack: the real vLLM, vllm-ascend, verl and FlashRL Python
# code from the package registry, runnable on a machine without an NPU (npu_flashrl emulates torch_npu).
# Idempotent: a stamp holding the hash of the pins and of this script makes a second run a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NPU_FLASHRL_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
REQS="${NPU_FLASHRL_CPU_REQS:-$ROOT/requirements/cpu-stack.txt}"
CACHE="${NPU_FLASHRL_CACHE:-$ROOT/.cache/bootstrap}"
PIP_FLAGS="${PIP_FLAGS:---quiet --disable-pip-version-check}"
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1

log() { printf '[bootstrap] %s\n' "$*" >&2; }
run() {
  log "+ $*"
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}

# Packages of one "# [section]" block of the pins file.
section() {
  awk -v want="$1" '
    /^# \[/ { match($0, /\[[^]]+\]/); cur = substr($0, RSTART + 1, RLENGTH - 2); next }
    /^[[:space:]]*(#|$)/ { next }
    cur == want { print $1 }
  ' "$REQS"
}

"$PYTHON" - <<'PY' || { log "Python >= 3.10 is required (PYTHON=$PYTHON)"; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY

stamp_want="$(cat "$REQS" "${BASH_SOURCE[0]}" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
stamp_file="$VENV/.npu_flashrl_stack"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_want" ]]; then
  log "CPU stack already installed in $VENV (pins unchanged)"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || run "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# shellcheck disable=SC2206  # PIP_FLAGS is a list of flags on purpose
PIP=("$PY" -m pip $PIP_FLAGS)
mkdir -p "$CACHE"

# torch first and pinned for every later step: a second torch would be a CUDA build of several GB.
mapfile -t torch_pin < <(section torch)
constraints="$CACHE/constraints.txt"
printf '%s\n' "${torch_pin[@]}" > "$constraints"
run "${PIP[@]}" install -c "$constraints" "${torch_pin[@]}"

mapfile -t build_pkgs < <(section build)
run "${PIP[@]}" install -c "$constraints" "${build_pkgs[@]}"

mapfile -t deps < <(section deps)
run "${PIP[@]}" install -c "$constraints" "${deps[@]}"

# vLLM from its sdist with the empty target: the binary wheels are CUDA builds.
mapfile -t sdists < <(section sdist-empty)
for spec in "${sdists[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  if "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$name').split('+')[0] == '$version' else 1)" 2>/dev/null; then
    log "$spec already installed"
    continue
  fi
  run "${PIP[@]}" download --no-deps --no-build-isolation --no-binary "$name" -d "$CACHE" "$spec"
  tarball="$(ls "$CACHE/$name-$version".tar.gz)"
  VLLM_TARGET_DEVICE=empty run "${PIP[@]}" install --no-deps --no-build-isolation "$tarball"
done

mapfile -t nodeps < <(section nodeps)
run "${PIP[@]}" install --no-deps -c "$constraints" "${nodeps[@]}"

# The project itself, editable, without re-resolving its (already present) dependencies.
run "${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

if [[ "$DRY_RUN" == 0 ]]; then
  "$PY" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  echo "$stamp_want" > "$stamp_file"
fi
log "CPU stack ready in $VENV"
