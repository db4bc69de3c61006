"""`npu-flashrl`: FlashRL-compatible command line for Ascend.

Subcommands (flags as `flashrl` 1.0.3 where it has them):

* ``profile -m BF16_DIR -q W8A8_DIR -o OUT.pt [--fn int8]``
* ``setup -m MODEL -p PROFILE --fn FN -o CONFIG [-a] [key=value ...]``
* ``cleanup [-p CONFIG] [--site-dir DIR]``
* ``verify [--config F] [--json] [--strict] [--apply-patches]``
* ``rehearse ...`` (added by `npu_flashrl.rehearsal` when present; see `_add_rehearse`)

Exit codes: 0 success, 1 a check/operation failed (message says what and the fix), 2 bad usage.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import yaml

from npu_flashrl._logging import get_logger
from npu_flashrl.errors import CliError  # noqa: F401  (re-exported: npu_flashrl.cli.CliError)
from npu_flashrl.verify import (  # noqa: F401  (re-exported: npu_flashrl.cli.verify_rows, ...)
    FAIL, INFO, OK, WARN, W8A8_FIX, activation_rows, cann_roots, cann_row,
    cann_version, config_rows, format_table, line_row, package_rows, patch_rows, read_overrides,
    verify_rows, verl_rows)

logger = get_logger("cli")

PROG = "npu-flashrl"
DEFAULT_CONFIG_OUTPUT = os.path.join("~", ".flashrl_config.yaml")  # FlashRL's default


def _out(msg: str = "") -> None:
    print(msg, file=sys.stdout)


# ============================================================================ profile

def _add_profile(sub) -> None:
    p = sub.add_parser(
        "profile", help="compute FlashRL's int8 profile from a bf16 and a W8A8 checkpoint",
        description="Compute FlashRL's int8 profile (same keys, shapes and meaning as FlashRL 1.0.3's "
                    "`flashrl profile`) layer by layer from the safetensors files.")
    p.add_argument("-m", "--model", help="the original (bf16) checkpoint dir")
    p.add_argument("-q", "--quantized", required=True,
                   help="the compressed-tensors W8A8 checkpoint dir (e.g. RedHatAI *-quantized.w8a8)")
    p.add_argument("-o", "--output", required=True, help="profile file to write (torch.save, .pt)")
    p.add_argument("--fn", default="int8", choices=["int8", "fp8"],
                   help="int8 (fp8 is refused: Ascend 910B has no FP8 matmul)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_profile)


def _run_profile(args) -> int:
    from npu_flashrl.profile import make_profile

    if args.fn != "int8":
        raise CliError("--fn fp8: FP8 profiles are not supported: Ascend 910B (Atlas A2) has no FP8 "
                       "matmul; use --fn int8", code=2)
    if not args.model:
        raise CliError("--fn int8 needs the original bf16 checkpoint: -m BF16_DIR", code=2)
    _refuse_overwriting_a_checkpoint_file(args.output, (args.model, args.quantized))
    profile = make_profile(args.model, args.quantized, args.output, fn=args.fn,
                           progress=not args.no_progress)
    _out(f"int8 profile with {len(profile)} entries written to {args.output}")
    return 0


def _refuse_overwriting_a_checkpoint_file(output: str, dirs) -> None:
    """-o must not replace a file of -m / -q (a shard, config.json) by a profile; a previous profile there
    (FlashRL's default place is <w8a8>/profile.pt) may be replaced."""
    from npu_flashrl.profile import ProfileError, load_profile

    if not os.path.isfile(output):
        return
    parent = os.path.realpath(os.path.dirname(os.path.abspath(output)))
    if parent not in {os.path.realpath(d) for d in dirs if d}:
        return
    try:
        load_profile(output)
    except ProfileError:
        suggestion = os.path.join(parent, "profile.pt")
        other = (f"e.g. {suggestion}" if os.path.realpath(output) != os.path.realpath(suggestion)
                 else "outside the checkpoint dir")
        raise CliError(f"-o {output}: an existing file of the checkpoint dir {os.path.dirname(output) or '.'} "
                       f"that is not a profile; not replaced (move it away yourself if it is not needed, or "
                       f"choose another -o, {other})") from None


# ============================================================================ setup

def parse_value(text: str) -> Any:
    """A key=value value: a Python literal (what FlashRL users wrote for its eval) or YAML; never eval."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CliError(f"cannot parse value {_short(text)}: neither a Python literal nor YAML ({exc})", code=2)
    except RecursionError:
        raise CliError(f"cannot parse value {_short(text)}: nested too deeply (expected a string, number, "
                       f"list or mapping a few levels deep)", code=2) from None


def _short(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def parse_columns(columns: Sequence[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for column in columns:
        if column == "--":
            continue
        key, sep, value = column.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "a").isalnum():
            raise CliError(f"bad argument {column!r}: expected key=value "
                           f"(e.g. module_attribute_to_preserve='[\"workspace\"]')", code=2)
        out[key] = parse_value(value)
    return out


def _add_setup(sub) -> None:
    from npu_flashrl.config import ALL_FLASHRL_FNS, SUPPORTED_FNS

    p = sub.add_parser(
        "setup", help="write a FlashRL config (YAML `configs:` list) for FLASHRL_CONFIG",
        description="Write a FlashRL-schema config. With -a, append an entry to an existing config "
                    "(hybrid rollout: DP group i uses entry i %% n). The profile is checked against the "
                    "model before anything is written. Unlike `flashrl setup`, nothing is added to "
                    "usercustomize.py: npu_flashrl activates through its vLLM plugin when "
                    "FLASHRL_CONFIG is set.")
    p.add_argument("-m", "--model", help="the rollout model (for int8: the W8A8 checkpoint dir)")
    p.add_argument("-p", "--profile", help="int8 profile (default at run time: <model>/profile.pt)")
    p.add_argument("--fn", default="int8", metavar="FN",
                   help=f"one of {', '.join(SUPPORTED_FNS)} (FlashRL names: "
                        f"{', '.join(f for f in ALL_FLASHRL_FNS if f not in SUPPORTED_FNS)}); default int8")
    p.add_argument("-o", "--config-output", default=None,
                   help=f"config file to write (default {DEFAULT_CONFIG_OUTPUT})")
    p.add_argument("-a", "--append", action="store_true", help="append an entry to an existing config")
    p.add_argument("--no-check", action="store_true",
                   help="do not check the model dir and the profile (e.g. a model that is not local)")
    p.add_argument("--force", action="store_true",
                   help="replace an -o file that is not a FlashRL config, and keep entry keys that "
                        "neither npu_flashrl nor FlashRL reads")
    p.add_argument("columns", nargs=argparse.REMAINDER, metavar="key=value",
                   help="extra entry keys, values as Python/YAML literals, e.g. "
                        "load_format=auto module_attribute_to_preserve='[\"workspace\"]'")
    p.set_defaults(func=_run_setup)


def _check_model_dir(model: str, what: str = "model") -> None:
    if not os.path.isdir(model):
        raise CliError(f"-m {model}: {what} dir not found (pass --no-check for a model that is not local)")
    try:
        names = os.listdir(model)
    except OSError as exc:
        raise CliError(f"-m {model}: cannot list the {what} dir: {exc.strerror or exc}") from None
    if not any(f.endswith(".safetensors") for f in names):
        raise CliError(f"-m {model}: no *.safetensors files in the {what} dir (a safetensors HF "
                       f"checkpoint is needed)")
    from npu_flashrl.checkpoint import checkpoint_problem

    problem = checkpoint_problem(model)  # every shard's header, for every fn (no tensor data read)
    if problem:
        raise CliError(f"-m {model}: {problem}")



def _check_w8a8(model: str) -> None:
    from npu_flashrl.profile import MOE_FIX, check_w8a8_checkpoint, corrupt_scale_problems, moe_profile_problem

    moe = moe_profile_problem(model)
    if moe:
        raise CliError(f"--fn int8 -m {model}: {moe}\nfix: {MOE_FIX}")
    problems = check_w8a8_checkpoint(model)
    if problems:
        raise CliError(f"--fn int8 -m {model}: " + "; ".join(problems) + f"\nfix: {W8A8_FIX}")
    problems = corrupt_scale_problems(model)
    if problems:
        raise CliError(f"--fn int8 -m {model}: " + "; ".join(problems))


def build_entry(fn: str, model: Optional[str], profile: Optional[str], columns: Dict[str, Any],
                check: bool = True, allow_unknown_keys: bool = False):
    """The config entry `setup` writes, validated (profile vs model when check)."""
    from npu_flashrl.config import ConfigError, RolloutConfig, needs_profile, unknown_key_problems
    from npu_flashrl.profile import ProfileError, check_profile_against_model, load_profile

    try:
        data = RolloutConfig.default(fn).to_dict()
    except ConfigError as exc:
        raise CliError(f"--fn: {exc}", code=2) from None
    if model is not None:
        data["model"] = model
    if profile is not None:
        data["profile"] = profile
    data.update(columns)
    try:
        entry = RolloutConfig.from_dict(data, "new entry")
    except ConfigError as exc:
        raise CliError(str(exc), code=2) from None
    unknown = unknown_key_problems(entry, "key=value")
    if unknown and not allow_unknown_keys:
        raise CliError("\n  ".join(unknown) + "\n(--force keeps such keys)", code=2)
    if profile is not None and not needs_profile(entry):
        raise CliError(f"-p {profile}: only --fn int8 uses a profile (--fn {entry.fn} would ignore it)", code=2)
    if needs_profile(entry) and not entry.model:
        raise CliError(f"--fn {entry.fn} needs -m MODEL (the W8A8 checkpoint dir)", code=2)
    if needs_profile(entry) and str(entry.load_format).lower() == "dummy":
        raise CliError(f"load_format=dummy with --fn {entry.fn}: the W8A8 model would keep random "
                       "weight_scale tensors that no weight sync replaces; drop it (setup writes "
                       "load_format: auto)", code=2)
    if check:
        if entry.model:
            _check_model_dir(entry.model)
        if needs_profile(entry):
            _check_w8a8(entry.model)
            path = entry.profile_path()
            try:
                prof = load_profile(path)
            except ProfileError as exc:
                raise CliError(f"-p: {exc}") from None
            offenders = check_profile_against_model(prof, entry.model)
            if offenders:
                raise CliError(f"profile {path} does not match model {entry.model}; first offenders:\n  "
                               + "\n  ".join(offenders)
                               + "\nfix: make the profile for this model: npu-flashrl profile -m BF16 "
                                 f"-q {entry.model} -o {path}")
    return entry


def _run_setup(args) -> int:
    from npu_flashrl.checkpoint import architecture_mismatch
    from npu_flashrl.config import (ConfigError, FlashRLConfig, load_config, locked_file,
                                    output_path_problem, write_config, write_target)

    output = os.path.expanduser(args.config_output or DEFAULT_CONFIG_OUTPUT)
    if args.config_output is None:
        _out(f"No -o given; writing {output} (FlashRL's default)")
    # everything about -o first: the profile check below reads the whole model
    problem = output_path_problem(output)
    if problem:
        raise CliError(f"-o {problem}")
    if args.append and not os.path.exists(output):
        raise CliError(f"-a: {output} does not exist, nothing to append to (drop -a to create it)")
    if args.append:  # read again under the lock below; this finds a bad file before any work
        try:
            load_config(output)
        except ConfigError as exc:
            raise CliError(f"-a: the existing config cannot be appended to: {exc}") from None
    elif os.path.exists(output) and not args.force:
        try:
            load_config(output)
        except ConfigError as exc:
            raise CliError(f"-o {output}: exists and is not a FlashRL config, not replaced ({exc}); "
                           f"pass --force to replace it") from None
    columns = parse_columns(args.columns)
    entry = build_entry(args.fn, args.model, args.profile, columns, check=not args.no_check,
                        allow_unknown_keys=args.force)
    try:
        if args.append:
            with locked_file(output):  # read-modify-write under the lock: concurrent -a keep every entry
                try:
                    cfg = load_config(output)
                except ConfigError as exc:
                    raise CliError(f"-a: the existing config cannot be appended to: {exc}") from None
                cfg.entries.append(entry)
                mismatch = architecture_mismatch([(f"configs[{i}]", e.model) for i, e in enumerate(cfg.entries)
                                                  if e.model and os.path.isdir(e.model)])
                if mismatch and not args.no_check:
                    raise CliError(f"-a {output}: the new entry {mismatch}; not appended")
                write_config(cfg, output)
        else:
            cfg = FlashRLConfig(entries=[entry], path=output)
            write_config(cfg, output)
    except OSError as exc:
        raise CliError(f"-o {output}: cannot write: {exc.strerror or exc} (nothing changed)") from None
    through = f" (through the symlink, to {write_target(output)})" if os.path.islink(output) else ""
    _out(f"FlashRL config with {len(cfg.entries)} entr{'y' if len(cfg.entries) == 1 else 'ies'} "
         f"written to {output}{through}")
    _out(f"Enable it with: export FLASHRL_CONFIG={output}")
    return 0


# ============================================================================ cleanup

def _add_cleanup(sub) -> None:
    p = sub.add_parser(
        "cleanup", help="undo setup: disable FlashRL's usercustomize.py auto-import, remove a config",
        description="Comment out FlashRL's `import flash_rl` lines in usercustomize.py (as `flashrl "
                    "cleanup` does) in every site-packages dir, atomically. With -p, also remove "
                    "that config file (only if it is a FlashRL config).")
    p.add_argument("-p", "--path", help="a config written by setup to remove")
    p.add_argument("--site-dir", action="append", default=None,
                   help="site dir holding usercustomize.py (default: site.getsitepackages() and the "
                        "user site); repeatable")
    p.add_argument("--dry-run", action="store_true", help="only say what would change")
    p.set_defaults(func=_run_cleanup)


def disable_usercustomize(path: str, dry_run: bool = False) -> List[str]:
    """Comment out FlashRL's import lines in one usercustomize.py. Returns messages; raises CliError
    for a line it cannot safely change (nothing is written then)."""
    import tokenize

    from npu_flashrl.config import atomic_write

    try:  # Python's own rule for a source file's encoding (a coding: line, else UTF-8), kept on write
        with open(path, "rb") as fb:
            encoding, _ = tokenize.detect_encoding(fb.readline)
        with open(path, encoding=encoding, newline="") as f:
            lines = f.readlines()
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror or exc} (not changed)") from None
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise CliError(f"{path}: not a text file in its declared encoding (UTF-8 without a coding: line): "
                       f"{getattr(exc, 'reason', None) or exc}; not changed: Python cannot import it either, "
                       f"fix or remove it by hand") from None
    changed, notes = False, []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if "import flash_rl" in stripped and not stripped.startswith("#"):
            if stripped == "import flash_rl":
                lines[i] = "# " + lines[i]
                changed = True
            elif stripped == "try: import flash_rl":
                lines[i] = "# " + lines[i]
                nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
                if nxt.startswith("except") and not nxt.startswith("#"):
                    lines[i + 1] = "# " + lines[i + 1]
                    i += 1
                changed = True
            else:
                raise CliError(f"{path}:{i + 1}: FlashRL import in an unknown form, not changed: "
                               f"{stripped!r}; remove it by hand")
        i += 1
    if changed:
        if not dry_run:
            data = "".join(lines).encode(encoding)
            try:
                atomic_write(path, lambda f: f.write(data), binary=True)
            except OSError as exc:
                raise CliError(f"{path}: cannot write: {exc.strerror or exc} (nothing changed; run cleanup "
                               f"with the permissions of that site dir, or comment out `import flash_rl` "
                               f"there by hand)") from None
        notes.append(f"{'would disable' if dry_run else 'disabled'} `import flash_rl` in {path}")
    return notes


def _run_cleanup(args) -> int:
    from npu_flashrl.adapters.flashrl import site_packages_dirs, usercustomize_files
    from npu_flashrl.config import ConfigError, load_config

    dirs = args.site_dir if args.site_dir else site_packages_dirs()
    notes: List[str] = []
    for path in usercustomize_files(dirs):
        notes += disable_usercustomize(path, dry_run=args.dry_run)
    if args.path:
        if not os.path.exists(args.path):
            notes.append(f"{args.path}: no such config (nothing to remove)")
        else:
            try:
                load_config(args.path)
            except ConfigError as exc:
                raise CliError(f"-p {args.path}: not removed, it is not a FlashRL config ({exc})") from None
            if not args.dry_run:
                try:
                    os.remove(args.path)
                except OSError as exc:
                    raise CliError(f"-p {args.path}: cannot remove: {exc.strerror or exc}") from None
            notes.append(f"{'would remove' if args.dry_run else 'removed'} config {args.path}")
    if os.environ.get("FLASHRL_CONFIG"):
        notes.append(f"FLASHRL_CONFIG={os.environ['FLASHRL_CONFIG']} is still set in this shell: "
                     f"unset FLASHRL_CONFIG")
    for n in notes or ["nothing to clean up"]:
        _out(n)
    return 0


# ============================================================================ verify

def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify", help="check the stack, the config/profile and the patches; non-zero exit on failure",
        description="Print package versions against npu_flashrl/pins.yaml, torch_npu/CANN presence (or "
                    "'emulated'), whether the config and its profiles are readable and match the model, "
                    "and every registered patch. Exit 1 when a required check fails (each with its fix).")
    p.add_argument("--config", help="config to check (default: $FLASHRL_CONFIG)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--strict", action="store_true", help="warnings (version drift, emulation) fail too")
    p.add_argument("--apply-patches", action="store_true",
                   help="apply every registered patch in this process before listing them")
    p.add_argument("--verl-overrides", metavar="FILE",
                   help="also check verl Hydra overrides: a file (one per line, or a recipe's --dry-run "
                        "output) or '-' for stdin, e.g. `bash RECIPE --dry-run | npu-flashrl verify "
                        "--verl-overrides -`; refuses rollout modes and TIS settings that silently do "
                        "nothing at verl 51d2104")
    p.set_defaults(func=_run_verify)


def _run_verify(args) -> int:
    rows = verify_rows(args.config, args.apply_patches, getattr(args, "verl_overrides", None))
    failing = [r for r in rows if r["status"] == FAIL or (args.strict and r["status"] == WARN)]
    if args.json:
        _out(json.dumps({"ok": not failing, "strict": bool(args.strict), "rows": rows}, indent=2))
    else:
        _out(format_table(rows))
        _out("")
        _out(f"{len(failing)} check(s) failed" if failing else "all required checks passed")
    return 1 if failing else 0


# ============================================================================ rehearse (hook)

def _add_rehearse(sub) -> None:
    """HOOK for `npu-flashrl rehearse`, owned by `npu_flashrl.rehearsal` (written separately).

    That module provides `add_arguments(parser)` and `run(args) -> int` (and optionally `HELP`).
    An ImportError *inside* an existing rehearsal module is not hidden.
    """
    if importlib.util.find_spec("npu_flashrl.rehearsal") is None:
        return
    rehearsal = importlib.import_module("npu_flashrl.rehearsal")
    help_text = getattr(rehearsal, "HELP", "rehearse an INT8 rollout end to end")
    p = sub.add_parser("rehearse", help=help_text, description=help_text)
    rehearsal.add_arguments(p)
    p.set_defaults(func=rehearsal.run)


# ============================================================================ main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="FlashRL-compatible INT8 rollouts on Ascend NPUs (vllm-ascend + verl).")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    _add_profile(sub)
    _add_setup(sub)
    _add_cleanup(sub)
    _add_verify(sub)
    _add_rehearse(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from npu_flashrl.config import ConfigError
    from npu_flashrl.profile import ProfileError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except (ConfigError, ProfileError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
