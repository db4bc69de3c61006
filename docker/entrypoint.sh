#!/usr/bin/env bash
# Container entrypoint: loads the CANN and ATB environments, then runs the given command.
set -euo pipefail
ASCEND_HOME="${ASCEND_HOME:-/usr/local/Ascend}"
for env_script in "$ASCEND_HOME/ascend-toolkit/set_env.sh" "$ASCEND_HOME/nnal/atb/set_env.sh"; do
  if [[ -f "$env_script" ]]; then
    set +u
    # shellcheck disable=SC1090  # path depends on ASCEND_HOME
    source "$env_script"
    set -u
  else
    echo "[entrypoint] warning: $env_script not found" >&2
  fi
done
exec "$@"
