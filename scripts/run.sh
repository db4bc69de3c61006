#!/usr/bin/env bash
# The project's main job on an embedded default: sets up the CPU stack (idempotent), then runs the
# CPU rehearsal of the INT8 rollout pipeline (`npu-flashrl rehearse`; extra args are passed on).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NPU_FLASHRL_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/bootstrap_cpu_stack.sh"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"
exec "$VENV/bin/npu-flashrl" "${NPU_FLASHRL_MAIN_JOB:-rehearse}" "$@"
