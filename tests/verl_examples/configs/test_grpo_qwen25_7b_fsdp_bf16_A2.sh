#!/usr/bin/env bash
# bf16 baseline verl launch: exactly test_grpo_qwen25_7b_fsdp_int8_A2.sh with ROLLOUT_PRECISION=bf16,
# so both runs share every setting except the rollout quantization (FLASHRL_CONFIG optional here).
#
# Usage: test_grpo_qwen25_7b_fsdp_bf16_A2.sh [--dry-run] [extra Hydra overrides ...]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_sets ROLLOUT_PRECISION bf16
exec bash "$HERE/test_grpo_qwen25_7b_fsdp_int8_A2.sh" "$@"
