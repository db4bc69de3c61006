#!/usr/bin/env bash
# Installs one line of the npu_flashrl production stack on an Atlas A2 (910B) / A3 node with CANN
# already installed: torch + torch_npu, vLLM (empty target), vllm-ascend, MindSpeed, Megatron-LM,
# verl, transformers, FlashRL, then npu_flashrl itself, and ends with `npu-flashrl verify`.
#   --line pinned   (default) the published FlashRL procedure: vLLM, vllm-ascend (custom kernels
#                   built for SOC_VERSION), verl and transformers from pinned commits
#   --line current  verl server mode on today's vLLM / vllm-ascend: vLLM from its tag (empty
#                   target), vllm-ascend, verl and transformers releases from the package index
#   (the versions of each line: docs/compatibility.md, `python3 npu_flashrl/pins.py --line L table`)
#
# Every version comes from npu_flashrl/pins.yaml (or $NPU_FLASHRL_PINS); nothing is pinned here.
# A component pinned with a repo and a commit/ref is built from source; one with only a version is
# installed from the package index. Idempotent: a component already at its pin is skipped, one at
# another commit/version is re-installed.
#
# Usage: scripts/install_pinned.sh [--line NAME] [--dry-run] [--workdir DIR] [--log FILE]
#                                  [--only NAME[,NAME..]] [--skip-checks] [--allow-mismatch]
#                                  [--no-verify] [--help]
#   --line names: the lines of the pins file (pinned, current; anything else is refused)
#   --only names: torch torch_npu vllm vllm_ascend mindspeed megatron_core mbridge verl transformers
#                 flash_llm_rl npu_flashrl (anything else is refused)
#
# Environment (all optional):
#   LINE                  stack line                      (default: pinned; same as --line)
#   NPU_FLASHRL_PINS      pins file                       (default: npu_flashrl/pins.yaml of this checkout)
#   PYTHON                interpreter to install into     (default: python3)
#   WORKDIR               where sources are cloned        (default: $HOME/npu_flashrl_stack)
#   LOG_FILE              log file                        (default: $WORKDIR/install_pinned.log)
#   MIN_FREE_GB           free disk needed in WORKDIR     (default: 60)
#   ASCEND_HOME           Ascend install root             (default: /usr/local/Ascend)
#   CANN_VERSION_FILE     file with a `version=` line     (default: the toolkit's ascend_toolkit_install.info)
#   SKIP_NPU_CHECK=1      do not require npu-smi (container builds have no driver mounted)
#   ALLOW_MISMATCH=1      Python / CANN version mismatches warn instead of stopping (same as --allow-mismatch)
#   SOC_VERSION           vllm-ascend kernel target       (default: pins soc_version, ascend910b1)
#   MAX_JOBS              parallel compile jobs           (default: nproc)
#   PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_TRUSTED_HOST  package index mirrors (read by pip itself)
#   TORCH_INDEX_URL       extra index for torch wheels (x86_64 CPU torch builds), empty = none
#   VLLM_ASCEND_EXTRA_INDEX_URLS  space-separated extra indexes for a vllm-ascend release
#                         (default: the pin's extra_index_urls, where its torch-npu / triton-ascend live)
#   <NAME>_REPO_URL       clone URL override per source component: VLLM, VLLM_ASCEND, TRANSFORMERS,
#                         MINDSPEED, MEGATRON_CORE, VERL (default: the repo in the pins file)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORKDIR="${WORKDIR:-$HOME/npu_flashrl_stack}"
LOG_FILE="${LOG_FILE:-}"
MIN_FREE_GB="${MIN_FREE_GB:-60}"
ASCEND_HOME="${ASCEND_HOME:-/usr/local/Ascend}"
CANN_VERSION_FILE="${CANN_VERSION_FILE:-}"
SKIP_NPU_CHECK="${SKIP_NPU_CHECK:-0}"
ALLOW_MISMATCH="${ALLOW_MISMATCH:-0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 8)}"
LINE="${LINE:-pinned}"
DRY_RUN=0
SKIP_CHECKS=0
RUN_VERIFY=1
ONLY=""

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# The value of a `--flag=VALUE` argument; an empty one is refused by name (`--workdir=` planned
# clones at /, since "$WORKDIR/$name" is then "/$name").
eq_value() {
  local value="${1#*=}"
  if [[ -z "$value" ]]; then
    echo "install_pinned.sh: ${1%%=*}= needs a value (got an empty one; see --help)" >&2
    exit 2
  fi
  printf '%s' "$value"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --line) LINE="${2:?--line needs a line name}"; shift ;;
    --line=*) LINE="$(eq_value "$1")" ;;
    --workdir) WORKDIR="${2:?--workdir needs a directory}"; shift ;;
    --workdir=*) WORKDIR="$(eq_value "$1")" ;;
    --log) LOG_FILE="${2:?--log needs a file}"; shift ;;
    --log=*) LOG_FILE="$(eq_value "$1")" ;;
    --only) ONLY="${2:?--only needs component names}"; shift ;;
    --only=*) ONLY="$(eq_value "$1")" ;;
    --skip-checks) SKIP_CHECKS=1 ;;
    --allow-mismatch) ALLOW_MISMATCH=1 ;;
    --no-verify) RUN_VERIFY=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install_pinned.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Every numeric or 0/1 tunable is checked by pattern here, at the top level and before any
# arithmetic: bash arithmetic evaluates a variable's text as an expression, so an unchecked
# MIN_FREE_GB='HOME[$(cmd)]' would run cmd (even with --dry-run), and '60GB' would abort the
# command it is used in. `exit` (not `return`) so that no calling context can ignore a refusal.
require_number() {  # NAME REGEX WHAT
  local name="$1" regex="$2" what="$3" value
  value="${!name-}"
  if [[ ! "$value" =~ $regex ]]; then
    echo "install_pinned.sh: ERROR: $name must be $what, got '$value'" >&2
    exit 1
  fi
}
require_number MIN_FREE_GB '^(0|[1-9][0-9]{0,5})$' "a whole number of GB (0 to 999999, e.g. 60)"
require_number MAX_JOBS '^[1-9][0-9]{0,3}$' "a whole number of parallel compile jobs (1 to 9999)"
require_number SKIP_NPU_CHECK '^[01]$' "0 or 1"
require_number ALLOW_MISMATCH '^[01]$' "0 or 1"

COMPONENTS=(torch torch_npu vllm vllm_ascend mindspeed megatron_core mbridge verl transformers flash_llm_rl npu_flashrl)
if [[ -n "$ONLY" ]]; then
  IFS=, read -r -a only_names <<<"$ONLY"
  for name in "${only_names[@]}"; do
    if [[ ! " ${COMPONENTS[*]} " == *" $name "* ]]; then
      echo "install_pinned.sh: unknown component '$name' in --only (known: ${COMPONENTS[*]})" >&2
      exit 2
    fi
  done
fi

# cannot_write PATH: why PATH (a file or dir, created with its parents when missing) cannot be
# written; nothing printed when it can. Looks only, creates nothing (a dry run changes nothing).
cannot_write() {
  local path="$1" probe
  if [[ -e "$path" ]]; then
    [[ -w "$path" ]] || echo "$path is not writable"
    return 0
  fi
  probe="$(dirname "$path")"
  while [[ ! -e "$probe" ]]; do probe="$(dirname "$probe")"; done
  if [[ ! -d "$probe" ]]; then echo "$probe is not a directory"
  elif [[ ! -w "$probe" || ! -x "$probe" ]]; then echo "cannot create $path: $probe is not writable"
  fi
}
# Checked before anything else (also by a dry run): a log nobody can write would lose the record
# of a long install, and a WORKDIR nobody can write would fail halfway.
for target in "WORKDIR=$WORKDIR" "LOG_FILE=${LOG_FILE:-$WORKDIR/install_pinned.log}"; do
  problem="$(cannot_write "${target#*=}")"
  if [[ -n "$problem" ]]; then
    echo "install_pinned.sh: ERROR: ${target%%=*}: $problem (set --workdir / --log elsewhere)" >&2
    exit 1
  fi
done

# A real run logs to a file; a dry run only when --log/LOG_FILE is given (it must not create WORKDIR).
if [[ -z "$LOG_FILE" && "$DRY_RUN" == 0 ]]; then LOG_FILE="$WORKDIR/install_pinned.log"; fi
# A real write, not only an open: /dev/full or a full disk open fine and then lose every line.
# tee keeps the terminal going when the file fails, so its status is checked at exit (log_status);
# a coprocess, not >(tee): bash can wait only for its last process substitution.
if [[ -n "$LOG_FILE" ]]; then
  if ! why="$( { mkdir -p "$(dirname "$LOG_FILE")" &&
                 printf '[install_pinned] log of the run started %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$LOG_FILE"; } 2>&1)"; then
    echo "install_pinned.sh: ERROR: LOG_FILE=$LOG_FILE cannot be written (${why##*: }; set --log elsewhere)" >&2
    exit 1
  fi
  exec 3>&1 4>&2  # the terminal: tee's output, and a failure of the log itself
  coproc TEE { tee -a "$LOG_FILE" >&3 2>&4; }
  # shellcheck disable=SC2153  # TEE_PID is set by `coproc TEE`
  tee_pid="$TEE_PID" tee_fd="${TEE[1]}"
  exec >&"$tee_fd" 2>&1 {tee_fd}>&-
  log_status() {
    local rc=$? tee_rc=0
    exec >&3 2>&4  # closes the last writer of the pipe: tee finishes
    wait "$tee_pid" || tee_rc=$?
    if [[ "$tee_rc" != 0 ]]; then
      echo "install_pinned.sh: ERROR: LOG_FILE=$LOG_FILE: writing the log failed (tee exit status $tee_rc);" \
           "the record of this run is incomplete (set --log elsewhere)" >&2
      [[ "$rc" != 0 ]] || rc=1
    fi
    exit "$rc"
  }
  trap log_status EXIT
fi

log() { printf '[install_pinned] %s\n' "$*"; }
die() { printf '[install_pinned] ERROR: %s\n' "$*" >&2; exit 1; }
# Print a command (shell-quoted) and run it unless --dry-run.
run() {
  local q
  printf -v q ' %q' "$@"
  printf '+%s\n' "$q"
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}
# Same, inside a directory.
run_in() {
  local dir="$1"; shift
  local q
  printf -v q ' %q' "$@"
  printf '+ (cd %q &&%s)\n' "$dir" "$q"
  if [[ "$DRY_RUN" == 0 ]]; then (cd "$dir" && "$@"); fi
}
wanted() { [[ -z "$ONLY" || ",$ONLY," == *",$1,"* ]]; }

log "$(date -u +%Y-%m-%dT%H:%M:%SZ) start (dry_run=$DRY_RUN workdir=$WORKDIR log=${LOG_FILE:-none})"

# ---------------------------------------------------------------- pins
python_path="$(command -v -- "$PYTHON")" || die "PYTHON=$PYTHON: no such interpreter (not found, or not executable; set PYTHON=/path/to/python3.10)"
case "$python_path" in /*) ;; *) python_path="$PWD/$python_path" ;; esac
PYTHON="$python_path"
PINS_READER="$ROOT/npu_flashrl/pins.py"
[[ -f "$PINS_READER" ]] || die "pins reader missing: $PINS_READER (run this script from an npu_flashrl checkout)"
if ! "$PYTHON" -c 'import yaml' 2>/dev/null; then
  log "PyYAML is needed to read the pins file"
  run "$PYTHON" -m pip install pyyaml
fi
known_lines="$("$PYTHON" "$PINS_READER" lines)" || die "cannot read the pins file (NPU_FLASHRL_PINS=${NPU_FLASHRL_PINS:-default})"
if ! grep -qxF -- "$LINE" <<<"$known_lines"; then
  echo "install_pinned.sh: unknown line '$LINE' (known: $(echo "$known_lines" | paste -sd' ' -))" >&2
  exit 2
fi
pins_sh="$("$PYTHON" "$PINS_READER" --line "$LINE" sh)" || die "cannot read line '$LINE' of the pins file (NPU_FLASHRL_PINS=${NPU_FLASHRL_PINS:-default})"
eval "$pins_sh"
log "pins file: $("$PYTHON" "$PINS_READER" path), line $LINE"
# Every pin of the line, as read (the record of what this run installs).
while IFS= read -r assignment; do log "pin: $assignment"; done <<<"$pins_sh"
SOC_VERSION="${SOC_VERSION:-$PIN_SOC_VERSION}"

# ---------------------------------------------------------------- checks
FAILED_CHECKS=0
check_fail() {  # $1 = soft (downgradable by --allow-mismatch) or hard, rest = message
  local kind="$1"; shift
  if [[ "$kind" == soft && "$ALLOW_MISMATCH" == 1 ]]; then
    log "WARNING: $* (continuing: --allow-mismatch)"
  else
    log "CHECK FAILED: $*"
    FAILED_CHECKS=$((FAILED_CHECKS + 1))
  fi
}

find_cann_version_file() {
  local arch candidates f
  arch="$(uname -m)"
  candidates=(
    "$CANN_VERSION_FILE"
    "${ASCEND_TOOLKIT_HOME:-}/${arch}-linux/ascend_toolkit_install.info"
    "$ASCEND_HOME/ascend-toolkit/latest/${arch}-linux/ascend_toolkit_install.info"
    "$ASCEND_HOME/cann/${arch}-linux/ascend_toolkit_install.info"
  )
  for f in "${candidates[@]}"; do
    if [[ -n "$f" && -f "$f" ]]; then echo "$f"; return 0; fi
  done
  return 1
}

run_checks() {
  log "checks: Python $PIN_PYTHON, CANN $PIN_CANN, npu-smi, ${MIN_FREE_GB} GB free in $WORKDIR, git"
  local pyver
  pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [[ "$pyver" == "$PIN_PYTHON" ]]; then
    log "ok: Python $pyver ($PYTHON)"
  else
    check_fail soft "Python $pyver at '$PYTHON', the $LINE stack needs Python $PIN_PYTHON (set PYTHON=...)"
  fi

  local vfile cann
  if vfile="$(find_cann_version_file)"; then
    cann="$(sed -n 's/^version=//p' "$vfile" | head -n1)"
    if [[ "${cann^^}" == "${PIN_CANN^^}"* ]]; then
      log "ok: CANN $cann ($vfile)"
    else
      check_fail soft "CANN ${cann:-unknown} in $vfile, the $LINE stack needs CANN $PIN_CANN"
    fi
  else
    check_fail soft "CANN toolkit version info not found: looked for $ASCEND_HOME/ascend-toolkit/latest/$(uname -m)-linux/ascend_toolkit_install.info (install CANN $PIN_CANN, set ASCEND_HOME or CANN_VERSION_FILE)"
  fi

  if [[ "$SKIP_NPU_CHECK" == 1 ]]; then
    log "skip: npu-smi check (SKIP_NPU_CHECK=1)"
  elif command -v npu-smi >/dev/null 2>&1; then
    log "ok: npu-smi at $(command -v npu-smi)"
  else
    check_fail hard "npu-smi not found on PATH: the Ascend driver is not installed or not mounted (/usr/local/bin/npu-smi); set SKIP_NPU_CHECK=1 only for an image build"
  fi

  local probe="$WORKDIR" free_kb need_kb
  while [[ ! -d "$probe" ]]; do probe="$(dirname "$probe")"; done
  free_kb="$(df -Pk "$probe" | awk 'NR==2 {print $4}')" || free_kb=""
  need_kb=$((MIN_FREE_GB * 1024 * 1024))
  if [[ ! "$free_kb" =~ ^[0-9]{1,18}$ ]]; then  # not a number: no arithmetic on it
    check_fail hard "cannot read the free space at $probe (df -Pk gave '$free_kb')"
  elif [[ "$free_kb" -ge "$need_kb" ]]; then
    log "ok: $((free_kb / 1024 / 1024)) GB free at $probe"
  else
    check_fail hard "only $((free_kb / 1024 / 1024)) GB free at $probe, need ${MIN_FREE_GB} GB (set WORKDIR elsewhere or MIN_FREE_GB)"
  fi

  command -v git >/dev/null 2>&1 || check_fail hard "git not found (apt-get install git)"
  "$PYTHON" -c "import pip" >/dev/null 2>&1 || check_fail hard "pip not available for $PYTHON"

  CHECKS_DONE=1
}

# The verdict is taken here, at the top level, from a flag set on the last line of run_checks: an
# error that abandons run_checks part-way (bash drops the rest of the command on an expansion
# error, whatever set -e says; it drops the whole enclosing top-level command, hence one command
# per line here) leaves the flag unset and stops the run too.
CHECKS_DONE=0
if [[ "$SKIP_CHECKS" == 1 ]]; then log "skip: checks (--skip-checks)"; CHECKS_DONE=1; fi
if [[ "$SKIP_CHECKS" != 1 ]]; then run_checks; fi
[[ "$CHECKS_DONE" == 1 ]] || die "the checks stopped part-way (see the error above); nothing was installed"
if [[ "$FAILED_CHECKS" -gt 0 && "$DRY_RUN" == 1 ]]; then
  log "dry run: $FAILED_CHECKS check(s) failed; a real run would stop here"
fi
[[ "$FAILED_CHECKS" == 0 || "$DRY_RUN" == 1 ]] \
  || die "$FAILED_CHECKS check(s) failed, nothing was installed (see messages above)"

# ---------------------------------------------------------------- helpers for components
STAMPS="$WORKDIR/.installed"
PIP=("$PYTHON" -m pip install --disable-pip-version-check)
CONSTRAINTS="$WORKDIR/constraints.txt"

# Version of an installed distribution, empty when absent (no import of the package itself).
dist_version() {
  "$PYTHON" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1" 2>/dev/null || true
}

# Is <dist> installed at <rev> from <dir>? Checks the stamp written after a successful install,
# the distribution metadata, and the checkout's HEAD (a checkout moved since the install counts as wrong).
at_pin() {
  local name="$1" dist="$2" rev="$3" dir="$4"
  [[ -f "$STAMPS/$name" && "$(cat "$STAMPS/$name")" == "$rev" ]] || return 1
  [[ -n "$(dist_version "$dist")" ]] || return 1
  if [[ -d "$dir/.git" ]]; then
    local head want
    head="$(git -C "$dir" rev-parse HEAD 2>/dev/null)" || return 1
    want="$(git -C "$dir" rev-parse "$(local_rev "$dir" "$rev")^{commit}" 2>/dev/null)" || return 1
    [[ "$head" == "$want" ]] || return 1
  fi
  return 0
}

stamp() {
  if [[ "$DRY_RUN" == 0 ]]; then mkdir -p "$STAMPS" && printf '%s\n' "$2" > "$STAMPS/$1"; fi
}

# The name to check out for <rev> in <dir>: <rev> itself (a commit, tag or local branch), else
# origin/<rev> when it is a branch of the remote only (MindSpeed / Megatron-LM core_r0.16.0).
local_rev() {
  local dir="$1" rev="$2"
  if ! git -C "$dir" rev-parse -q --verify "$rev^{commit}" >/dev/null 2>&1 \
      && git -C "$dir" rev-parse -q --verify "origin/$rev^{commit}" >/dev/null 2>&1; then
    echo "origin/$rev"
  else
    echo "$rev"
  fi
}

# Clone (once) and check out <rev> (a commit, short commit, tag or branch), detached.
checkout() {
  local url="$1" rev="$2" dir="$3"
  if [[ ! -d "$dir/.git" ]]; then
    run git clone --filter=blob:none "$url" "$dir"
  else
    run git -C "$dir" remote set-url origin "$url"
  fi
  if [[ "$DRY_RUN" == 1 ]] || ! git -C "$dir" rev-parse -q --verify "$rev^{commit}" >/dev/null 2>&1; then
    run git -C "$dir" fetch --tags origin
  fi
  if [[ "$DRY_RUN" == 0 ]]; then rev="$(local_rev "$dir" "$rev")"; fi
  run git -C "$dir" checkout --detach "$rev"
}

# env_args <PIN_PREFIX>: "KEY=VALUE" words of packages.<name>.env for `env`.
env_args() {
  local prefix="$1" var key
  for var in $(compgen -v "${prefix}_ENV_"); do
    key="${var#"${prefix}_ENV_"}"
    printf '%s=%s\n' "$key" "${!var}"
  done
}

# install_source <name> <dist> <rev> <steps function>: clone/checkout, then the component's steps run
# with COMP_DIR (the checkout) and COMP_ENV (KEY=VALUE words of packages.<name>.env) set.
COMP_DIR=""
COMP_ENV=()
install_source() {
  local name="$1" dist="$2" rev="$3" steps="$4"
  local upper url_var default_url url
  upper="${name^^}"
  url_var="${upper}_REPO_URL"
  default_url="PIN_PACKAGES_${upper}_REPO"
  url="${!url_var:-${!default_url}}"
  COMP_DIR="$WORKDIR/$name"
  if ! wanted "$name"; then log "skip: $name (not in --only)"; return 0; fi
  if at_pin "$name" "$dist" "$rev" "$COMP_DIR"; then
    log "skip: $name already at $rev"
    return 0
  fi
  log "step: $name -> $rev from $url"
  checkout "$url" "$rev" "$COMP_DIR"
  mapfile -t COMP_ENV < <(env_args "PIN_PACKAGES_${upper}")
  "$steps"
  stamp "$name" "$rev"
}
pip_in_comp() { run_in "$COMP_DIR" env "${COMP_ENV[@]}" "$@" "${PIP[@]}" -c "$CONSTRAINTS" "${PIP_ARGS[@]}"; }
PIP_ARGS=()

# pin_of <name> <field>: packages.<name>.<field> of the line, empty when the line has none.
pin_of() {
  local var="PIN_PACKAGES_${1^^}_${2^^}"
  printf '%s' "${!var:-}"
}

# Build requirements first, then no build isolation: an isolated build would pull another torch.
# The torch lines of vLLM's build requirements are filtered out (vLLM 0.23's ask for torch 2.11.0,
# vllm-ascend 0.23 needs 2.10.0): the constraints keep the line's torch.
steps_vllm() {
  local reqs
  reqs="$(pin_of vllm build_requirements)"
  reqs="${reqs:-requirements/build.txt}"
  run_in "$COMP_DIR" sh -c "grep -v -E '^[[:space:]]*(torch|--|#|-r)' $reqs > build-reqs.npu_flashrl.txt"
  PIP_ARGS=(-r build-reqs.npu_flashrl.txt); pip_in_comp
  PIP_ARGS=(--no-build-isolation -e .); pip_in_comp
  # triton comes along on x86_64 but does not work on Ascend.
  if [[ "$DRY_RUN" == 1 || -n "$(dist_version triton)" ]]; then
    run "$PYTHON" -m pip uninstall -y triton
  fi
}
# vllm-ascend with its custom kernels for the A2 SoC. Its requirements.txt asks for a torch-npu dev
# build from another index: torch lines and index options are filtered out so the pinned torch_npu
# stays (see docs/compatibility.md).
steps_vllm_ascend() {
  # libascend_hal.so lives in the driver; a build without a mounted driver links against the devlib stub.
  local devlib
  devlib="$ASCEND_HOME/ascend-toolkit/latest/$(uname -m)-linux/devlib"
  if [[ -d "$devlib" ]]; then
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$devlib"
    log "LD_LIBRARY_PATH += $devlib"
  fi
  run_in "$COMP_DIR" sh -c "grep -v -E '^[[:space:]]*(torch|--|#)' requirements.txt > build-reqs.npu_flashrl.txt"
  PIP_ARGS=(-r build-reqs.npu_flashrl.txt); pip_in_comp
  PIP_ARGS=(--no-build-isolation -e .); pip_in_comp "SOC_VERSION=$SOC_VERSION" "MAX_JOBS=$MAX_JOBS"
}
# Megatron-LM without deps (they are all present by then); MindSpeed is editable with deps (source only:
# the registry's `mindspeed` is an empty placeholder).
steps_no_deps() { PIP_ARGS=(--no-deps -e .); pip_in_comp; }
# verl with its NPU requirements, then the package itself without re-resolving.
steps_verl() {
  PIP_ARGS=(-r requirements-npu.txt); pip_in_comp
  PIP_ARGS=(--no-deps -e .); pip_in_comp
}
steps_editable() { PIP_ARGS=(-e .); pip_in_comp; }

install_release() {  # install_release <name> <dist> <version> [extra pip args]
  local name="$1" dist="$2" version="$3"; shift 3
  if ! wanted "$name"; then log "skip: $name (not in --only)"; return 0; fi
  local have
  have="$(dist_version "$dist")"
  if [[ "${have%%+*}" == "$version" ]]; then
    log "skip: $dist already $have"
    return 0
  fi
  log "step: $dist ${have:-absent} -> $version"
  run "${PIP[@]}" -c "$CONSTRAINTS" "$@" "$dist==$version"
}

# install_component <name> <source steps> [pip args for a release]: from source when the line pins
# a repo and a commit/ref, else the release of its version from the package index.
install_component() {
  local name="$1" steps="$2"; shift 2
  local dist rev version
  dist="$(pin_of "$name" dist)"
  dist="${dist:-${name//_/-}}"
  rev="$(pin_of "$name" commit)"
  rev="${rev:-$(pin_of "$name" ref)}"
  version="$(pin_of "$name" version)"
  if [[ -n "$(pin_of "$name" repo)" && -n "$rev" ]]; then
    install_source "$name" "$dist" "$rev" "$steps"
  elif [[ -n "$version" ]]; then
    install_release "$name" "$dist" "$version" "$@"
  elif [[ -n "$(compgen -v "PIN_PACKAGES_${name^^}_" || true)" ]]; then
    die "pins: packages.$name of line $LINE has neither repo + commit/ref nor version"
  else
    log "skip: $name (not pinned in line $LINE)"
  fi
}

# ---------------------------------------------------------------- install
run mkdir -p "$WORKDIR"
# Every later step keeps the line's torch / torch_npu (and transformers when it is a release pin).
constraints=("torch==$PIN_PACKAGES_TORCH_VERSION" "torch_npu==$PIN_PACKAGES_TORCH_NPU_VERSION")
if [[ -z "$(pin_of transformers commit)" && -n "$(pin_of transformers version)" ]]; then
  constraints+=("transformers==$(pin_of transformers version)")
fi
log "step: constraints file $CONSTRAINTS (${constraints[*]})"
if [[ "$DRY_RUN" == 0 ]]; then
  printf '%s\n' "${constraints[@]}" > "$CONSTRAINTS"
fi

# CANN environment for the compiled parts (vllm-ascend custom kernels, torch_npu checks).
for env_script in "$ASCEND_HOME/ascend-toolkit/set_env.sh" "$ASCEND_HOME/nnal/atb/set_env.sh"; do
  if [[ -f "$env_script" ]]; then
    log "source $env_script"
    set +u
    # shellcheck disable=SC1090  # path depends on ASCEND_HOME
    source "$env_script"
    set -u
  else
    log "note: $env_script not found (needed to compile vllm-ascend kernels)"
  fi
done

torch_extra=()
[[ -n "$TORCH_INDEX_URL" ]] && torch_extra=(--extra-index-url "$TORCH_INDEX_URL")
install_release torch torch "$PIN_PACKAGES_TORCH_VERSION" "${torch_extra[@]}"
install_release torch_npu torch-npu "$PIN_PACKAGES_TORCH_NPU_VERSION" "${torch_extra[@]}"

# vLLM with the empty target (pure Python; the Ascend platform comes from vllm-ascend).
install_component vllm steps_vllm
# A vllm-ascend release comes with its torch-npu / triton-ascend from Huawei's indexes (its docs).
ascend_index_args=()
for url in ${VLLM_ASCEND_EXTRA_INDEX_URLS:-$(pin_of vllm_ascend extra_index_urls)}; do
  ascend_index_args+=(--extra-index-url "$url")
done
install_component vllm_ascend steps_vllm_ascend "${ascend_index_args[@]}"
install_component mindspeed steps_editable
install_component megatron_core steps_no_deps
# mbridge (current line: verl's Megatron engine with vanilla_mbridge=True); its deps are present
install_component mbridge steps_no_deps --no-deps
install_component verl steps_verl
# transformers last among the sources so no requirement file moves it off its commit (a release
# pin is in the constraints file from the start).
install_component transformers steps_editable
# FlashRL from the registry without its (CUDA) dependencies.
install_component flash_llm_rl steps_editable --no-deps

if wanted npu_flashrl; then
  log "step: npu_flashrl (editable, from $ROOT)"
  run "${PIP[@]}" --no-deps -e "$ROOT"
fi

if [[ "$RUN_VERIFY" == 1 ]]; then
  log "step: npu-flashrl verify"
  verify_cmd="$(dirname "$PYTHON")/npu-flashrl"
  [[ -x "$verify_cmd" ]] || verify_cmd=npu-flashrl
  run "$verify_cmd" verify
else
  log "skip: npu-flashrl verify (--no-verify)"
fi
log "done$([[ "$DRY_RUN" == 1 ]] && echo ' (dry run: nothing was changed)')"
