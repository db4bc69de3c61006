#!/usr/bin/env bash
# The project's main job on an embedded default: sets up the CPU stack of one line (idempotent;
# NPU_FLASHRL_LINE, default 0.11), then runs the CPU rehearsal of the INT8 rollout pipeline
# (`npu-flashrl rehearse`; extra args are passed on).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINE="${NPU_FLASHRL_LINE:-0.11}"
bash "$ROOT/scripts/bootstrap_cpu_stack.sh" --line "$LINE"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export VLLM_PLUGINS="${VLLM_PLUGINS:-none}"
exec "${NPU_FLASHRL_VENVS:-$ROOT/.venvs}/$LINE/bin/npu-flashrl" "${NPU_FLASHRL_MAIN_JOB:-rehearse}" "$@"
