#!/usr/bin/env bash
# Sourced by ../common.sh (not executed): quoting Hydra values and shell words, printing or running a
# command (--dry-run).
# hydra_value VALUE: VALUE as one Hydra override value that reads back as the same string. Plain
# paths and names stay as they are; anything else (non-ASCII, spaces, ( ) = # [ ] { } ~ & ' " $ \ ,
# or a word Hydra would type, such as null or 1e5) is double-quoted the way Hydra's override grammar
# takes quoted values: a backslash before each quote, backslashes doubled where they end the value
# or precede a quote, and '${' written '\${' (else OmegaConf would interpolate it).
# hydra_str VALUE: the same, always single-quoted (Ray's runtime env takes strings only: '3000').
hydra_value() {
  if [[ "$1" =~ ^[A-Za-z_/.][A-Za-z0-9_/.@%+-]*$ && ! "${1,,}" =~ ^(true|false|null|nan|inf)$ ]]; then
    printf '%s' "$1"
  else
    hydra_quote '"' "$1"
  fi
}
hydra_str() { hydra_quote "'" "$1"; }
hydra_quote() {
  local q="$1" s="$2" out="" run="" c i
  for (( i = 0; i < ${#s}; i++ )); do
    c="${s:i:1}"
    case "$c" in
      \\) run+="\\" ;;
      "$q") out+="$run$run\\$q"; run="" ;;
      '$') if [[ "${s:i+1:1}" == '{' ]]; then out+="$run"'\$'; else out+="$run$c"; fi; run="" ;;
      *) out+="$run$c"; run="" ;;
    esac
  done
  printf '%s%s%s' "$q" "$out$run$run" "$q"
}

# shell_word WORD: WORD quoted for a POSIX shell. %q, except for a word with non-ASCII characters,
# which %q writes as $'\346...' in a C locale (neither POSIX sh nor Python's shlex, which
# `npu-flashrl verify --verl-overrides -` reads this with, knows that form): single quotes instead.
shell_word() {
  if [[ "$1" == *[![:ascii:]]* ]]; then
    local q="'\\''"
    printf "'%s'" "${1//\'/$q}"
  else
    printf '%q' "$1"
  fi
}

# print_cmd ARGS...: one shell-quoted command, ready to copy-paste; every KEY=VALUE word (environment
# assignment or Hydra override) starts a continued line of its own.
print_cmd() {
  local first=1 a
  for a in "$@"; do
    if [[ "$first" == 1 ]]; then
      shell_word "$a"; first=0
    elif [[ "$a" =~ ^[+~]?[A-Za-z_][A-Za-z0-9_.]*= ]]; then
      printf ' \\\n    '; shell_word "$a"
    else
      printf ' '; shell_word "$a"
    fi
  done
  printf '\n'
}

# run_or_print ARGS...: print the command; execute it unless --dry-run.
run_or_print() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '# dry run, not executed:\n'
    print_cmd "$@"
  else
    recipe_log "+ $*"
    "$@"
  fi
}
