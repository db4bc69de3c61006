"""`npu-flashrl`: FlashRL-compatible command line for Ascend.

Subcommands (flags as `flashrl` 1.0.3 where it has them):

* ``profile -m BF16_DIR -q W8A8_DIR -o OUT.pt [--fn int8]``
* ``setup -m MODEL -p PROFILE --fn FN -o CONFIG [-a] [key=value ...]``
* ``cleanup [-p CONFIG] [--site-dir DIR]``
* ``verify [--config F] [--json] [--strict] [--apply-patches] [--kernels]``
* ``rehearse ...`` (added by `npu_flashrl.rehearsal` when present; see `_add_rehearse`)

Exit codes: 0 success, 1 a check/operation failed (message says what and the fix), 2 bad usage.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Optional, Sequence

from npu_flashrl import commands
from npu_flashrl._logging import get_logger
from npu_flashrl.commands import DEFAULT_CONFIG_OUTPUT
from npu_flashrl.errors import CliError

logger = get_logger(__name__)

PROG = "npu-flashrl"


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
    profile = commands.write_profile(args.model, args.quantized, args.output, fn=args.fn,
                                     progress=not args.no_progress)
    _out(f"int8 profile with {len(profile)} entries written to {args.output}")
    return 0


# ============================================================================ setup

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
    p.add_argument("--fn", default=None, metavar="FN",
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


def _run_setup(args) -> int:
    if args.config_output is None:
        _out(f"No -o given; writing {os.path.expanduser(DEFAULT_CONFIG_OUTPUT)} (FlashRL's default)")
    cfg = commands.setup(args.fn, args.model, args.profile, args.config_output, append=args.append,
                         check=not args.no_check, force=args.force, columns=args.columns)
    from npu_flashrl.config import write_target

    through = f" (through the symlink, to {write_target(cfg.path)})" if os.path.islink(cfg.path) else ""
    _out(f"FlashRL config with {len(cfg.entries)} entr{'y' if len(cfg.entries) == 1 else 'ies'} "
         f"written to {cfg.path}{through}")
    _out(f"Enable it with: export FLASHRL_CONFIG={os.path.abspath(cfg.path)}")  # read in other dirs too
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


def _run_cleanup(args) -> int:
    notes = commands.cleanup(args.path, args.site_dir, dry_run=args.dry_run)
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
    p.add_argument("--strict", action="store_true",
                   help="warnings (version drift, emulation) fail too; with --kernels, an op that accepts "
                        "an input its Huawei page rejects fails too")
    p.add_argument("--apply-patches", action="store_true",
                   help="apply every registered patch in this process before listing them")
    p.add_argument("--verl-overrides", metavar="FILE",
                   help="also check verl Hydra overrides: a file (one per line, or a recipe's --dry-run "
                        "output) or '-' for stdin, e.g. `bash RECIPE --dry-run | npu-flashrl verify "
                        "--verl-overrides -`; refuses rollout modes and TIS settings that silently do "
                        "nothing on the sync-mode verl line")
    p.add_argument("--kernels", action="store_true",
                   help="run the op-level conformance cases of the torch_npu ops npu_flashrl uses: on "
                        "an NPU host against the device, elsewhere against the emulation; one row per "
                        "op, exit 1 on a difference (takes only --json and --strict)")
    p.set_defaults(func=_run_verify)


def _verify_error(args, message: str, code: int) -> int:
    """A verify that cannot run: JSON on stdout under --json (every outcome is JSON), the message on
    stderr either way."""
    if args.json:
        _out(json.dumps({"ok": False, "strict": bool(args.strict), "error": message, "rows": []}, indent=2))
    print(f"{PROG} verify: error: {message}", file=sys.stderr)
    return code


def _run_verify(args) -> int:
    from npu_flashrl import verify
    from npu_flashrl.errors import NpuFlashrlError

    if getattr(args, "kernels", False):
        given = [flag for flag, value in (("--config", args.config),
                                          ("--verl-overrides", getattr(args, "verl_overrides", None)),
                                          ("--apply-patches", args.apply_patches)) if value]
        if given:
            return _verify_error(args, f"--kernels runs only the torch_npu op conformance cases and does not "
                                       f"read {', '.join(given)}: run `{PROG} verify {' '.join(given)} ...` "
                                       f"separately (--kernels takes only --json and --strict)", 2)
        text, ok = verify.kernel_conformance(as_json=args.json, strict=args.strict)
        _out(text)
        return 0 if ok else 1
    try:
        rows = verify.verify_rows(args.config, args.apply_patches, getattr(args, "verl_overrides", None))
    except NpuFlashrlError as exc:
        return _verify_error(args, str(exc), getattr(exc, "code", 1))
    failing = verify.failing_rows(rows, strict=args.strict)
    if args.json:
        _out(json.dumps({"ok": not failing, "strict": bool(args.strict), "rows": rows}, indent=2))
    else:
        _out(verify.format_table(rows))
        _out("")
        _out(f"{len(failing)} check(s) failed" if failing else "all required checks passed")
    return 1 if failing else 0


# ============================================================================ preflight

def _add_preflight(sub) -> None:
    from npu_flashrl.recipes import preflight

    p = sub.add_parser("preflight", help=preflight.HELP, description=preflight.__doc__.split("\n\n")[0])
    preflight.add_arguments(p)
    p.set_defaults(func=preflight.run)


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
    _add_preflight(sub)
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
