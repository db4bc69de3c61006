#!/usr/bin/env bash
# Starts an npu_flashrl container on an Atlas A2 node with the Ascend devices, driver, npu-smi and
# install info mounted, host networking (HCCL, Ray) and a large /dev/shm.
#
# Usage: docker/run.sh [--dry-run] [command ...]     (default command: bash)
#   e.g. docker/run.sh npu-flashrl verify
#        docker/run.sh bash tests/verl_examples/flash_rl/grpo_qwen25_7b_fsdp_int8_A2.sh
#
# Environment (defaults in brackets):
#   IMAGE            [npu_flashrl:a2]          NPU_FLASHRL_CONTAINER (container name) [npu_flashrl]
#   NPU_DEVICES      NPU ids to expose [0,1,2,3,4,5,6,7]
#   SHM_SIZE         [500g]                    DOCKER          [docker]
#   ASCEND_DRIVER    [/usr/local/Ascend/driver]  NPU_SMI [/usr/local/bin/npu-smi]  DCMI_DIR [/usr/local/dcmi]
#   ASCEND_INFO      [/etc/ascend_install.info]
#   HOST_MODELS      host dir mounted at the same path, e.g. $HOME/models [empty]
#   HOST_DATA        host dir mounted at the same path, e.g. $HOME/data [empty]
#   EXTRA_RUN_ARGS   extra `docker run` arguments [empty]
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == --dry-run || "${1:-}" == -n ]]; then DRY_RUN=1; shift; fi
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0
fi
IMAGE="${IMAGE:-npu_flashrl:a2}"
NPU_FLASHRL_CONTAINER="${NPU_FLASHRL_CONTAINER:-npu_flashrl}"
NPU_DEVICES="${NPU_DEVICES:-0,1,2,3,4,5,6,7}"
SHM_SIZE="${SHM_SIZE:-500g}"
DOCKER="${DOCKER:-docker}"
ASCEND_DRIVER="${ASCEND_DRIVER:-/usr/local/Ascend/driver}"
NPU_SMI="${NPU_SMI:-/usr/local/bin/npu-smi}"
DCMI_DIR="${DCMI_DIR:-/usr/local/dcmi}"
ASCEND_INFO="${ASCEND_INFO:-/etc/ascend_install.info}"
HOST_MODELS="${HOST_MODELS:-}"
HOST_DATA="${HOST_DATA:-}"
EXTRA_RUN_ARGS="${EXTRA_RUN_ARGS:-}"

# NPU_DEVICES becomes /dev/davinci<id> mounts and SHM_SIZE a docker size: checked by pattern (an
# id such as '../sda' would mount another device).
if [[ ! "$NPU_DEVICES" =~ ^(0|[1-9][0-9]{0,2})(,(0|[1-9][0-9]{0,2}))*$ ]]; then
  echo "run.sh: NPU_DEVICES must be comma-separated NPU ids (e.g. 0,1,2,3), got '$NPU_DEVICES'" >&2
  exit 1
fi
if [[ ! "$SHM_SIZE" =~ ^[1-9][0-9]{0,9}[bkmgBKMG]?$ ]]; then
  echo "run.sh: SHM_SIZE must be a size such as 500g or 64G, got '$SHM_SIZE'" >&2
  exit 1
fi

missing=()
args=("$DOCKER" run --rm --name "$NPU_FLASHRL_CONTAINER" --net=host --shm-size="$SHM_SIZE")
if [[ -t 0 ]]; then args+=(-it); fi
IFS=',' read -r -a ids <<<"$NPU_DEVICES"
for id in "${ids[@]}"; do
  [[ -e "/dev/davinci$id" ]] || missing+=("/dev/davinci$id")
  args+=(--device "/dev/davinci$id")
done
for dev in /dev/davinci_manager /dev/devmm_svm /dev/hisi_hdc; do
  [[ -e "$dev" ]] || missing+=("$dev")
  args+=(--device "$dev")
done
for path in "$DCMI_DIR" "$NPU_SMI" "$ASCEND_DRIVER" "$ASCEND_INFO"; do
  [[ -e "$path" ]] || missing+=("$path")
done
args+=(-v "$DCMI_DIR:/usr/local/dcmi" -v "$NPU_SMI:/usr/local/bin/npu-smi"
       -v "$ASCEND_DRIVER:/usr/local/Ascend/driver" -v "$ASCEND_INFO:/etc/ascend_install.info")
for host_dir in "$HOST_MODELS" "$HOST_DATA"; do
  if [[ -n "$host_dir" ]]; then
    [[ -d "$host_dir" ]] || missing+=("$host_dir")
    args+=(-v "$host_dir:$host_dir")
  fi
done
extra=()
[[ -n "$EXTRA_RUN_ARGS" ]] && read -r -a extra <<<"$EXTRA_RUN_ARGS"
args+=("${extra[@]}" "$IMAGE")
if [[ $# -gt 0 ]]; then args+=("$@"); else args+=(bash); fi

if [[ ${#missing[@]} -gt 0 ]]; then
  for m in "${missing[@]}"; do echo "run.sh: missing on this host: $m" >&2; done
  if [[ "$DRY_RUN" == 0 ]]; then
    echo "run.sh: not an Ascend host with the driver installed (or set NPU_DEVICES / ASCEND_DRIVER / NPU_SMI ...)" >&2
    exit 1
  fi
fi
printf '+'; printf ' %q' "${args[@]}"; printf '\n'
if [[ "$DRY_RUN" == 0 ]]; then
  command -v "$DOCKER" >/dev/null 2>&1 || { echo "run.sh: '$DOCKER' not found" >&2; exit 1; }
  exec "${args[@]}"
fi
