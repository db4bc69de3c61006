#!/usr/bin/env bash
# The project's test command: sets up the CPU test stack on a fresh machine (idempotent), then runs
# the test suite on the real vLLM / vllm-ascend / verl / FlashRL code with emulated torch_npu.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NPU_FLASHRL_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/bootstrap_cpu_stack.sh"
cd "$ROOT"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"
exec "$VENV/bin/python" -m pytest -q "${@:-tests}"
