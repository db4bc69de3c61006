#!/usr/bin/env bash
# verl 0.9 server-mode GRPO launch: Qwen2.5-7B, FSDP trainer, vLLM-Ascend 0.23 rollout with INT8
# weights through npu_flashrl, on one Atlas 800T A2 node (8x 910B). The same launch as
# test_grpo_qwen25_7b_fsdp_int8_A2.sh (the pinned line) with RECIPE_LINE=current, which switches in
# ../common.sh only what verl 0.9.1 does differently:
#   * no actor_rollout_ref.rollout.mode (verl 0.7+ removed sync; the rollout is a vLLM server whose
#     workers get every weight sync in buckets through update_weights_from_ipc);
#   * actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes from
#     UPDATE_WEIGHTS_BUCKET_MB;
#   * TIS in decoupled mode at token level (bypass_mode=False, rollout_is=token: verl 0.9.1's driver
#     computes min(exp(old - rollout), C) and the workers' vanilla PPO loss multiplies it in), no
#     use_policy_gradient key (0.7+ has none);
#   * preflight: sync mode, rollout.quantization / qat next to FLASHRL_CONFIG and a VLLM_PLUGINS
#     without npu_flashrl are refused before anything starts; without --dry-run the verl that PYTHON
#     imports must be a server-mode one (0.7.1+).
# FLASHRL_CONFIG reaches verl's vLLM server, EngineCore and worker processes on every node through
# +ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG and npu_flashrl's vLLM plugin
# (docs/verl_server_mode.md); on several nodes it must be a path that exists on each.
#
# Normally started by ../flash_rl/grpo_qwen25_7b_fsdp_int8_A2_verl09.sh, which prepares FLASHRL_CONFIG.
#
# Usage: test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh [--dry-run] [extra Hydra overrides ...]
#
# Environment: everything listed in test_grpo_qwen25_7b_fsdp_int8_A2.sh, except that
#   TIS_LEVEL defaults to [token] and TIS_USE_POLICY_GRADIENT does not apply; plus
#   UPDATE_WEIGHTS_BUCKET_MB  sync bucket size in MB [2048, verl's default]: one buffer of this size
#                             per trainer rank (NPU memory with IPC, host shared memory without)
#   EXPERIMENT_NAME           [qwen25_7b_fsdp_${ROLLOUT_PRECISION}_A2_verl09]
#   PYTHON                    interpreter of the current stack (scripts/install_pinned.sh --line current)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../common.sh
source "$HERE/../common.sh"
recipe_help "$@"
recipe_sets RECIPE_LINE current
exec bash "$HERE/test_grpo_qwen25_7b_fsdp_int8_A2.sh" "$@"
