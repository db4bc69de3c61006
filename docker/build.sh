#!/usr/bin/env bash
# Builds the npu_flashrl image for Atlas A2 (default) or A3 and one stack line (pinned by default,
# or current), base image taken from that line of npu_flashrl/pins.yaml.
#
# Usage: docker/build.sh [--dry-run]
#
# Environment (defaults in brackets):
#   LINE         pinned | current [pinned] (a line of pins.yaml; anything else is refused)
#   TARGET       a2 | a3 [a2]
#   IMAGE        image tag [npu_flashrl:$TARGET for pinned, npu_flashrl:$LINE-$TARGET otherwise]
#   BASE_IMAGE   [pins docker.base_image_$TARGET of the line]
#   SOC_VERSION  [pins soc_version for a2; for a3 the line's soc_version_a3, else required]
#   DOCKER       docker client [docker]
#   BUILD_ARGS   extra `docker build` arguments, e.g. "--build-arg PIP_INDEX_URL=https://mirror/simple" []
#   PYTHON       interpreter used to read pins.yaml [python3]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0
case "${1:-}" in
  --dry-run|-n) DRY_RUN=1 ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "build.sh: unknown argument '$1'" >&2; exit 2 ;;
esac
LINE="${LINE:-pinned}"
TARGET="${TARGET:-a2}"
PYTHON="${PYTHON:-python3}"
DOCKER="${DOCKER:-docker}"
known_lines="$("$PYTHON" "$ROOT/npu_flashrl/pins.py" lines)" || { echo "build.sh: cannot read pins.yaml with $PYTHON" >&2; exit 1; }
if ! grep -qxF -- "$LINE" <<<"$known_lines"; then
  echo "build.sh: unknown LINE '$LINE' (known: $(echo "$known_lines" | paste -sd' ' -))" >&2
  exit 2
fi
pin() { "$PYTHON" "$ROOT/npu_flashrl/pins.py" --line "$LINE" get "$@"; }
case "$TARGET" in
  a2) SOC_VERSION="${SOC_VERSION:-$(pin soc_version)}" ;;
  a3) SOC_VERSION="${SOC_VERSION:-$(pin soc_version_a3 --default "")}"
      [[ -n "$SOC_VERSION" ]] || { echo "build.sh: set SOC_VERSION for A3 (see npu-smi info)" >&2; exit 1; } ;;
  *) echo "build.sh: TARGET must be a2 or a3, got '$TARGET'" >&2; exit 1 ;;
esac
BASE_IMAGE="${BASE_IMAGE:-$(pin "docker.base_image_$TARGET")}"
if [[ "$LINE" == pinned ]]; then IMAGE="${IMAGE:-npu_flashrl:$TARGET}"; else IMAGE="${IMAGE:-npu_flashrl:$LINE-$TARGET}"; fi
extra=()
[[ -n "${BUILD_ARGS:-}" ]] && read -r -a extra <<<"$BUILD_ARGS"

cmd=("$DOCKER" build -f "$ROOT/docker/Dockerfile" --build-arg "LINE=$LINE"
     --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "SOC_VERSION=$SOC_VERSION"
     "${extra[@]}" -t "$IMAGE" "$ROOT")
printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'
if [[ "$DRY_RUN" == 0 ]]; then
  command -v "$DOCKER" >/dev/null 2>&1 || { echo "build.sh: '$DOCKER' not found (install Docker or set DOCKER)" >&2; exit 1; }
  "${cmd[@]}"
fi
