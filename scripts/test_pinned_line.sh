#!/usr/bin/env bash
# Runs the vllm-ascend-facing tests against the PINNED production line (vllm 0.10.1 +
# vllm-ascend v0.10.1rc1) on a CPU, with npu_flashrl's emulated torch_npu.
#
# v0.10.1rc1 has no wheel, so this needs two things CI cannot make (both need the network, and
# neither is ever committed):
#   - a venv with vllm 0.10.1 built with VLLM_TARGET_DEVICE=empty, torch 2.13.0 (CPU) and the
#     test dependencies                       (NPU_FLASHRL_PINNED_VENV)
#   - a vllm-ascend source tree at the pinned commit (NPU_FLASHRL_VLLM_ASCEND_SRC; tests/conftest.py
#     puts it first on sys.path)
# When either is missing the script says how to make it and exits 2. It downloads nothing.
# Not for CI: CI runs the 0.11.0 line (scripts/bootstrap_cpu_stack.sh + scripts/test.sh).
#
# Usage: scripts/test_pinned_line.sh [--dry-run] [-- extra pytest args]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NPU_FLASHRL_PINNED_VENV:-$ROOT/.cache/venv-pinned}"
SRC="${NPU_FLASHRL_VLLM_ASCEND_SRC:-$ROOT/.cache/upstream/vllm-ascend-v0.10.1rc1}"
TESTS=(tests/test_vllm_ascend_reload.py tests/test_vllm_ascend_methods.py
       tests/test_cpu_harness.py tests/test_activation.py)
DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

log() { printf '[pinned-line] %s\n' "$*" >&2; }

# The pinned vllm-ascend commit, from the single source of truth.
pinned_commit() {
  awk '/^  vllm_ascend:/ { on = 1; next } /^  [a-z_]+:/ { on = 0 }
       on && $1 == "commit:" { print $2; exit }' "$ROOT/npu_flashrl/pins.yaml"
}

missing=0
if [[ ! -d "$SRC/vllm_ascend" ]]; then
  missing=1
  commit="$(pinned_commit)"
  log "vllm-ascend source tree not found: $SRC (expected $SRC/vllm_ascend/)"
  log "with network access, make it with (pinned commit ${commit:-?} from npu_flashrl/pins.yaml):"
  log "  git clone --filter=blob:none https://github.com/vllm-project/vllm-ascend.git /tmp/vllm-ascend"
  log "  mkdir -p '$SRC' && git -C /tmp/vllm-ascend archive ${commit:-<commit>} | tar -x -C '$SRC'"
  log "(or set NPU_FLASHRL_VLLM_ASCEND_SRC to an existing tree; never commit it)"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  missing=1
  log "pinned venv not found: $VENV (set NPU_FLASHRL_PINNED_VENV to use another)"
  log "with network access, make it with (torch must stay 2.13.0: pass the constraint to every pip call):"
  log "  python3 -m venv '$VENV' && echo torch==2.13.0 > /tmp/c.txt"
  log "  '$VENV/bin/pip' install -c /tmp/c.txt torch==2.13.0 setuptools-scm wheel"
  log "  '$VENV/bin/pip' download --no-deps --no-binary vllm -d /tmp/sdist vllm==0.10.1"
  log "  VLLM_TARGET_DEVICE=empty '$VENV/bin/pip' install --no-deps --no-build-isolation -c /tmp/c.txt /tmp/sdist/vllm-0.10.1.tar.gz"
  log "  '$VENV/bin/pip' install -c /tmp/c.txt cachetools cbor2 cloudpickle 'numpy<2' psutil regex setproctitle \\"
  log "      pyyaml pyzmq transformers==4.57.1 tokenizers msgspec pydantic blake3 pillow pybase64 gguf py-cpuinfo \\"
  log "      aiohttp einops safetensors tqdm pytest accelerate frozendict codetiming fastapi openai openai-harmony \\"
  log "      matplotlib ray tensordict omegaconf hydra-core pandas==3.0.6"
  log "  '$VENV/bin/pip' install --no-deps -c /tmp/c.txt compressed-tensors==0.11.0 flash-llm-rl==1.0.3 verl==0.6.1"
  log "  '$VENV/bin/pip' install --no-deps -e '$ROOT'"
fi

CMD=(env "NPU_FLASHRL_VLLM_ASCEND_SRC=$SRC" "$VENV/bin/python" -m pytest -q -rfEs "${TESTS[@]}" "${EXTRA[@]}")
if [[ "$DRY_RUN" == 1 ]]; then
  log "dry run; would run in $ROOT:"
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
if [[ "$missing" == 1 ]]; then
  log "cannot run the pinned-line tests (see above)"
  exit 2
fi

vllm_version="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)"
if [[ "$vllm_version" != 0.10.1* ]]; then
  log "warning: $VENV has vllm '${vllm_version:-not installed}', the pinned line is vllm 0.10.1"
fi
cd "$ROOT"
log "+ ${CMD[*]}"
exec "${CMD[@]}"
