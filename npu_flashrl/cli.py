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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from npu_flashrl._logging import get_logger
from npu_flashrl.errors import CliError  # noqa: F401  (re-exported: npu_flashrl.cli.CliError)

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
        raise CliError(f"-o {output}: is a file of the checkpoint dir {os.path.dirname(output) or '.'} and not a "
                       f"profile; not replaced (choose another -o, e.g. {os.path.join(parent, 'profile.pt')})") from None


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
        raise CliError(f"cannot parse value {text!r}: neither a Python literal nor YAML ({exc})", code=2)


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


W8A8_FIX = ("-m must be the W8A8 checkpoint (compressed-tensors w8a8, e.g. RedHatAI's, or a ModelSlim "
            "W8A8 export); for a bf16 checkpoint use --fn int8_profile_free")


def _check_w8a8(model: str) -> None:
    from npu_flashrl.profile import MOE_FIX, check_w8a8_checkpoint, moe_profile_problem

    moe = moe_profile_problem(model)
    if moe:
        raise CliError(f"--fn int8 -m {model}: {moe}\nfix: {MOE_FIX}")
    problems = check_w8a8_checkpoint(model)
    if problems:
        raise CliError(f"--fn int8 -m {model}: " + "; ".join(problems) + f"\nfix: {W8A8_FIX}")


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
    from npu_flashrl.config import (ConfigError, FlashRLConfig, load_config, locked_file,
                                    output_path_problem, write_config)

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
                write_config(cfg, output)
        else:
            cfg = FlashRLConfig(entries=[entry], path=output)
            write_config(cfg, output)
    except OSError as exc:
        raise CliError(f"-o {output}: cannot write: {exc.strerror or exc} (nothing changed)") from None
    _out(f"FlashRL config with {len(cfg.entries)} entr{'y' if len(cfg.entries) == 1 else 'ies'} "
         f"written to {output}")
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
    from npu_flashrl.config import atomic_write

    with open(path) as f:
        lines = f.readlines()
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
            atomic_write(path, lambda f: f.writelines(lines))
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
                os.remove(args.path)
            notes.append(f"{'would remove' if args.dry_run else 'removed'} config {args.path}")
    if os.environ.get("FLASHRL_CONFIG"):
        notes.append(f"FLASHRL_CONFIG={os.environ['FLASHRL_CONFIG']} is still set in this shell: "
                     f"unset FLASHRL_CONFIG")
    for n in notes or ["nothing to clean up"]:
        _out(n)
    return 0


# ============================================================================ verify

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"

# pins key -> (distribution names to try, required?)
_REQUIRED = {"torch": True, "vllm": True, "vllm_ascend": True, "transformers": True,
             "torch_npu": False, "verl": False, "flash_llm_rl": False, "mindspeed": False,
             "megatron_core": False}


def _row(check: str, status: str, detail: str, fix: str = "") -> Dict[str, str]:
    return {"check": check, "status": status, "detail": detail, "fix": fix}


def _dist_info(names: Sequence[str]):
    from npu_flashrl import pins as pins_mod

    return pins_mod.installed_version(names)


def _load_pins(line: Optional[str] = None):
    from npu_flashrl.pins import load_pins
    return load_pins(line=line)


def line_row() -> Tuple[Dict[str, str], Optional[str]]:
    """Which line of pins.yaml the installed stack matches (importlib.metadata versions vs each
    line's pins), and the line the package rows compare against: the matching one, else the
    closest (fewest differing packages)."""
    from npu_flashrl import pins as pins_mod

    order = pins_mod.line_names()
    name, diffs = pins_mod.match_line()
    detail = pins_mod.describe_match(name, diffs, order)
    if name:
        return _row("stack line", OK, detail), name
    closest = pins_mod.closest_line(diffs, order)
    return (_row("stack line", WARN, detail,
                 f"install one line: scripts/install_pinned.sh --line {closest} (package rows below "
                 f"compare against line '{closest}', the closest)"), closest)


def package_rows(pins: dict, line: Optional[str] = None) -> List[Dict[str, str]]:
    rows = []
    install = "scripts/install_pinned.sh" + (f" --line {line}" if line and line != "pinned" else "")
    for key, spec in (pins.get("packages") or {}).items():
        spec = spec or {}
        dist = spec.get("dist") or key.replace("_", "-")
        names = [dist, key, dist.replace("-", "_")]
        version, commit = _dist_info(names)
        want_v, want_c = spec.get("version"), spec.get("commit") or spec.get("ref")
        want = " ".join(x for x in (want_v and f"=={want_v}", want_c and f"@{str(want_c)[:12]}") if x)
        required = _REQUIRED.get(key, False)
        check = f"package {dist}"
        if key == "torch_npu":
            rows.append(_torch_npu_row(version, want_v))
            continue
        if version is None:
            status = FAIL if required else INFO
            rows.append(_row(check, status, f"missing (pinned {want or 'any'})",
                             f"install it: {install} (pinned {want})" if required else ""))
            continue
        have = version + (f"@{commit[:12]}" if commit else "")
        mismatch = []
        if want_v and version.split("+")[0] != str(want_v):
            mismatch.append(f"version {version} != {want_v}")
        if spec.get("commit") and commit and not str(commit).startswith(str(want_c)) \
                and not str(want_c).startswith(commit):
            mismatch.append(f"commit {commit[:12]} != {str(want_c)[:12]}")
        elif spec.get("commit") and not commit and not want_v:
            mismatch.append("installed without a recorded git commit: cannot tell whether it is the pinned one")
        elif spec.get("ref") and not spec.get("commit") and str(version.split("+")[0]) not in str(spec["ref"]):
            mismatch.append(f"version {version} is not ref {spec['ref']}")
        if key == "vllm_ascend":
            try:
                from npu_flashrl.compat import UnsupportedVersion, check_vllm_ascend
                line = check_vllm_ascend()
                have += f" (line {line})"
            except ImportError:
                pass
            except UnsupportedVersion as exc:
                rows.append(_row(check, FAIL, f"{have}: {exc}", f"install vllm-ascend {want}"))
                continue
        if mismatch:
            rows.append(_row(check, WARN, f"{have}; pinned {want}: {'; '.join(mismatch)}",
                             f"the tested stack is {want}: {install}"))
        else:
            rows.append(_row(check, OK, f"{have}" + (f" (pinned {want})" if want else "")))
    return rows


def _torch_npu_row(version: Optional[str], want: Optional[str]) -> Dict[str, str]:
    try:
        from npu_flashrl.kernels import emulation
        real = emulation.real_torch_npu_importable()
    except ImportError:
        real = importlib.util.find_spec("torch_npu") is not None
    if real:
        broken = _torch_npu_import_error()
        if broken:
            return _row("package torch_npu", FAIL, f"{version or 'installed'} but `import torch_npu` fails: {broken}",
                        f"reinstall torch_npu=={want} for this torch and source CANN's set_env.sh "
                        f"(scripts/install_pinned.sh --only torch_npu)")
        detail = f"{version or 'installed'}" + (f" (pinned {want})" if want else "")
        status = OK if not want or (version or "").split("+")[0] == str(want) else WARN
        return _row("package torch_npu", status, detail,
                    "" if status == OK else f"install torch_npu=={want}")
    return _row("package torch_npu", WARN, "emulated (no torch_npu: CPU reference kernels, no NPU)",
                f"on an Ascend machine install torch_npu=={want} (scripts/install_pinned.sh)")


_TORCH_NPU_ERROR: List[Optional[str]] = []


def _torch_npu_import_error() -> Optional[str]:
    """Why a present torch_npu cannot be imported (None: imports, or absent, or ours emulated)."""
    if not _TORCH_NPU_ERROR:
        error = None
        try:
            from npu_flashrl.kernels import emulation
            real = emulation.real_torch_npu_importable()
        except ImportError:
            real = importlib.util.find_spec("torch_npu") is not None
        if real:
            try:
                importlib.import_module("torch_npu")
            except Exception as exc:  # noqa: BLE001 - a broken install raises anything
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        _TORCH_NPU_ERROR.append(error)
    return _TORCH_NPU_ERROR[0]


def cann_roots() -> List[str]:
    roots = [os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH"),
             "/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann",
             os.path.expanduser("~/Ascend/ascend-toolkit/latest"), os.path.expanduser("~/Ascend/cann")]
    seen, out = set(), []
    for r in roots:
        if r and r not in seen:
            seen.add(r)
            out.append(r)
    return out


def _parse_version_file(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep and key.strip().lower() in ("version", "toolkit_version", "runtime_version"):
                    return value.strip().strip('"')
    except OSError:
        return None
    return None


def cann_version(roots: Optional[List[str]] = None) -> Optional[Dict[str, str]]:
    """CANN toolkit version from <root>/<arch>-linux/ascend_toolkit_install.info (CANN 8.x layout),
    else <root>/version.cfg or <root>/{compiler,runtime}/version.info. None when not found."""
    import glob

    for root in roots if roots is not None else cann_roots():
        if not os.path.isdir(root):
            continue
        candidates = sorted(glob.glob(os.path.join(root, "*-linux", "ascend_toolkit_install.info")))
        candidates += [os.path.join(root, "ascend_toolkit_install.info"), os.path.join(root, "version.cfg"),
                       os.path.join(root, "compiler", "version.info"), os.path.join(root, "runtime", "version.info")]
        for path in candidates:
            if os.path.exists(path):
                version = _parse_version_file(path)
                if version:
                    return {"version": version, "path": path}
    return None


def cann_row(pins: dict) -> Dict[str, str]:
    want = pins.get("cann")
    found = cann_version()
    row_name = "CANN toolkit"
    if found:
        v = found["version"]
        status = OK if not want or v.upper() == str(want).upper() else WARN
        return _row(row_name, status, f"{v} ({found['path']})" + (f"; pinned {want}" if status != OK else ""),
                    "" if status == OK else f"the tested CANN is {want}")
    try:
        from npu_flashrl.kernels import emulation
        real = emulation.real_torch_npu_importable()
    except ImportError:
        real = False
    if real:
        return _row(row_name, FAIL, "not found (torch_npu is installed but no CANN toolkit)",
                    "install CANN and `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
                    "(or set ASCEND_TOOLKIT_HOME)")
    return _row(row_name, WARN, "emulated (no CANN toolkit found; no NPU)",
                f"on an Ascend machine install CANN {want} and source its set_env.sh")


def activation_rows(config_path: Optional[str]) -> List[Dict[str, str]]:
    """Did `import npu_flashrl` activate from FLASHRL_CONFIG in this process (it runs before verify)?"""
    import npu_flashrl
    from npu_flashrl.config import ENV_CONFIG, ConfigError, lmhead_fp32_requested

    rows = []
    try:
        lmhead_fp32_requested()
    except ConfigError as exc:
        rows.append(_row("FLASHRL_LMHEAD_FP32", FAIL, str(exc), "export FLASHRL_LMHEAD_FP32=1 (or 0)"))
    error = getattr(npu_flashrl, "activation_error", None)
    if error:
        rows.append(_row("activation", FAIL, f"activation from {ENV_CONFIG} failed at import: {error}",
                         "fix the cause above; a rollout with this environment runs without npu_flashrl"))
    elif os.environ.get(ENV_CONFIG, "").strip() and not config_path \
            and os.environ.get("NPU_FLASHRL_NO_AUTOACTIVATE") != "1":
        rows.append(_row("activation", OK, f"activated from {ENV_CONFIG} at import"))
    return rows


def config_rows(config_path: Optional[str]) -> List[Dict[str, str]]:
    from npu_flashrl.config import (ENV_CONFIG, ConfigError, load_config, needs_profile,
                                    unknown_key_problems)
    from npu_flashrl.profile import ProfileError, check_profile_against_model, load_profile

    source = config_path if config_path else os.environ.get(ENV_CONFIG)
    label = f"config {source}" if source else "config"
    if not source:
        return [_row("config", WARN, f"no --config and {ENV_CONFIG} is not set: npu_flashrl stays inactive",
                     f"npu-flashrl setup ... -o CONFIG; export {ENV_CONFIG}=CONFIG")]
    try:
        cfg = load_config(source)
    except ConfigError as exc:
        return [_row(label, FAIL, str(exc), "fix the file, or rewrite it: npu-flashrl setup ... -o CONFIG")]
    rows = [_row(label, OK, f"{len(cfg.entries)} entr{'y' if len(cfg.entries) == 1 else 'ies'}: "
                 + ", ".join(e.fn for e in cfg.entries))]
    for i, entry in enumerate(cfg.entries):
        check = f"configs[{i}] ({entry.fn})"
        for problem in unknown_key_problems(entry, f"configs[{i}]"):
            rows.append(_row(check, FAIL, problem, "fix the key's spelling, or remove it"))
        if entry.model:
            if not os.path.isdir(entry.model):
                rows.append(_row(check, FAIL, f"model {entry.model}: no such dir",
                                 "point `model` at the local checkpoint dir"))
                continue
            if not any(f.endswith(".safetensors") for f in os.listdir(entry.model)):
                rows.append(_row(check, FAIL, f"model {entry.model}: no *.safetensors files",
                                 "use a safetensors HF checkpoint"))
                continue
        if not needs_profile(entry):
            rows.append(_row(check, OK, f"model {entry.model or '(the rollout model)'}"))
            continue
        fmt = str(entry.load_format).lower() if entry.load_format else None
        if fmt == "dummy":
            rows.append(_row(check, FAIL, f"load_format: {entry.load_format} with fn int8: random "
                             "weight_scale tensors that no weight sync replaces", "load_format: auto"))
            continue
        if fmt is None:
            rows.append(_row(check, WARN, "no load_format: the engine's own is used, and verl's sync "
                             "rollout passes dummy, which is refused at engine build for fn int8",
                             "load_format: auto"))
        if entry.model:
            from npu_flashrl.profile import MOE_FIX, check_w8a8_checkpoint, moe_profile_problem

            moe = moe_profile_problem(entry.model)
            if moe:
                rows.append(_row(check, FAIL, moe, MOE_FIX.replace("--fn ", "fn: ", 1)))
                continue
            problems = check_w8a8_checkpoint(entry.model)
            if problems:
                rows.append(_row(check, FAIL, "; ".join(problems), W8A8_FIX.replace("-m", "`model`", 1)))
                continue
        path = entry.profile_path()
        if path is None:
            rows.append(_row(check, WARN, "no `profile` and no `model`: profile resolved at run time "
                             "as <rollout model>/profile.pt, not checked", "set `profile` and `model`"))
            continue
        try:
            prof = load_profile(path)
        except ProfileError as exc:
            rows.append(_row(check, FAIL, str(exc), "npu-flashrl profile -m BF16 -q W8A8 -o PROFILE"))
            continue
        if not entry.model:
            rows.append(_row(check, WARN, f"profile {path} readable ({len(prof)} entries); no `model` "
                             "to check it against", "set `model` in the entry"))
            continue
        try:
            offenders = check_profile_against_model(prof, entry.model)
        except ProfileError as exc:
            rows.append(_row(check, FAIL, str(exc), "re-download or re-convert the checkpoint"))
            continue
        if offenders:
            rows.append(_row(check, FAIL, f"profile {path} does not match model {entry.model}: "
                             + "; ".join(offenders),
                             f"make the profile for this model: npu-flashrl profile -m BF16 -q {entry.model} -o {path}"))
        else:
            rows.append(_row(check, OK, f"profile {path} ({len(prof)} entries) matches model {entry.model}"))
    return rows


def patch_rows(apply: bool = False) -> List[Dict[str, str]]:
    from npu_flashrl import patches

    try:
        import npu_flashrl.adapters as adapters
        adapters.load_all()
    except (ImportError, AttributeError) as exc:
        logger.debug("adapters.load_all unavailable: %s", exc)
        for mod in ("npu_flashrl.adapters.flashrl",):
            try:
                importlib.import_module(mod)
            except ImportError:
                pass
    crashed: Dict[str, str] = {}
    if apply:
        for name in [p["name"] for p in patches.status()]:
            try:
                patches.apply_patch(name)
            except Exception as exc:  # noqa: BLE001 - a missing or broken torch_npu, say: one failed row
                crashed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    rows = []
    for p in patches.status():
        check = f"patch {p['name']}"
        detail = f"{p['target']} [{p['versions']}]"
        if p["name"] in crashed:
            error = crashed[p["name"]]
            fix = ("install the pinned torch_npu (scripts/install_pinned.sh --only torch_npu) and source "
                   "CANN's set_env.sh" if "torch_npu" in error or _torch_npu_import_error() else
                   "install the pinned version of the target (npu_flashrl/pins.yaml)")
            rows.append(_row(check, FAIL, f"applying it failed: {error} ({detail})", fix))
        elif p["applied"]:
            rows.append(_row(check, OK, f"applied in this process: {detail}"))
        elif p["error"]:
            rows.append(_row(check, WARN, f"not applied: {p['error']} ({detail})",
                             "install the pinned version of the target (npu_flashrl/pins.yaml)"))
        else:
            rows.append(_row(check, INFO, f"registered, not applied in this process (the vLLM plugin "
                             f"applies it when FLASHRL_CONFIG is set; --apply-patches tries now): {detail}"))
    if not rows:
        rows.append(_row("patches", INFO, "no patches registered"))
    return rows


def read_overrides(text: str) -> Tuple[List[str], Dict[str, str]]:
    """(Hydra overrides, environment assignments) of a verl command or an overrides file: one
    override per line or a recipe's ``--dry-run`` output (backslash continuations, ``env K=V``)."""
    import shlex

    words = shlex.split(text.replace("\\\n", " "), comments=True)
    env: Dict[str, str] = {}
    entry = "verl.trainer.main_ppo"
    if entry in words:
        for w in words[:words.index(entry)]:
            k, sep, v = w.partition("=")
            if sep and k.isidentifier():
                env[k] = v
        words = words[words.index(entry) + 1:]
    return [w for w in words if "=" in w and not w.startswith("-")], env


def verl_rows(path: str, verl: Optional[str] = None) -> List[Dict[str, str]]:
    """Check verl overrides (file, or '-' for stdin) the way the verl line ``verl`` (None: the
    installed verl's, 51d2104 when verl is absent; see compat.verl_line) would run them."""
    from npu_flashrl.adapters.verl import (RolloutModeError, TisConfigError, check_rollout_mode,
                                           overrides_to_config)

    label = f"verl overrides {path}"
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        return [_row(label, FAIL, f"cannot read: {exc}", "pass a file of Hydra overrides or '-' for stdin")]
    overrides, env = read_overrides(text)
    if not overrides:
        return [_row(label, FAIL, "no Hydra overrides (key=value) found",
                     "pass a recipe's --dry-run output or one override per line")]
    cfg = overrides_to_config(overrides)
    environ = dict(os.environ)
    environ.update(env)
    try:
        warnings = check_rollout_mode(cfg, environ=environ, verl=verl)
    except (RolloutModeError, TisConfigError) as exc:
        msg, _, fix = str(exc).partition(" Fix: ")
        return [_row(label, FAIL, msg, fix)]
    if warnings:
        return [_row(label, WARN, w) for w in warnings]
    from npu_flashrl import compat

    return [_row(label, OK, f"{len(overrides)} overrides: rollout mode and TIS settings work at verl "
                 f"{compat.verl_line(verl)}")]


def verify_rows(config_path: Optional[str] = None, apply_patches: bool = False,
                verl_overrides: Optional[str] = None) -> List[Dict[str, str]]:
    rows: List[Dict[str, str]] = []
    line: Optional[str] = None
    try:
        row, line = line_row()
        rows.append(row)
        pins = _load_pins(line)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        pins = {}
        rows.append(_row("pins.yaml", FAIL, str(exc), "reinstall npu_flashrl"))
    rows += package_rows(pins, line)
    rows.append(cann_row(pins))
    rows += activation_rows(config_path)
    rows += config_rows(config_path)
    if verl_overrides:
        rows += verl_rows(verl_overrides)
    rows += patch_rows(apply_patches)
    return rows


def format_table(rows: List[Dict[str, str]]) -> str:
    w1 = max(len(r["check"]) for r in rows)
    w2 = max([len("STATUS")] + [len(r["status"]) for r in rows])
    lines = [f"{'CHECK'.ljust(w1)}  {'STATUS'.ljust(w2)}  DETAIL", "-" * (w1 + w2 + 12)]
    for r in rows:
        lines.append(f"{r['check'].ljust(w1)}  {r['status'].ljust(w2)}  {r['detail']}")
        if r["fix"] and r["status"] in (FAIL, WARN):
            lines.append(f"{''.ljust(w1)}  {''.ljust(w2)}  fix: {r['fix']}")
    return "\n".join(lines)


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
