"""`npu-flashrl verify`: the checks behind it, one row each (check, status, detail, fix).

Packages against `pins.yaml` (the matching stack line, or what differs), torch_npu / CANN, the
FlashRL config and its profiles against their models, the registered patches, and optionally verl
Hydra overrides. `verify_rows` runs them all, `failing_rows` says which fail; `npu_flashrl.cli` wires the
subcommand and prints.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from npu_flashrl._logging import get_logger
from npu_flashrl.verify_config import (W8A8_FIX, architecture_rows, config_rows, description_rows,  # noqa: F401 (re-exported)
                                       tied_head_rows, w4a8_rows)
from npu_flashrl.verify_table import FAIL, INFO, OK, WARN, _row  # noqa: F401 (re-exported)

logger = get_logger(__name__)

# pins key -> (distribution names to try, required?)
_REQUIRED = {"torch": True, "vllm": True, "vllm_ascend": True, "transformers": True,
             "torch_npu": False, "verl": False, "flash_llm_rl": False, "mindspeed": False,
             "megatron_core": False, "mbridge": False}


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
                from npu_flashrl.lines import UnsupportedVersion, current as installed_line
                have += f" (line {installed_line().name})"
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


def _switch_rows() -> List[Dict[str, str]]:
    """The npu_flashrl environment tunables read at run time, refused here by name when they would
    be refused (or fall back to a default) there."""
    from npu_flashrl.adapters.flashrl import YIELD_ENV
    from npu_flashrl.adapters.verl import DEFAULT_WARN_THRESHOLD, WARN_ENV
    from npu_flashrl.values import SwitchError, env_switch

    rows = []
    try:
        env_switch(YIELD_ENV)
    except SwitchError as exc:
        rows.append(_row(YIELD_ENV, FAIL, str(exc), f"export {YIELD_ENV}=1 (or 0), or unset it"))
    raw = os.environ.get(WARN_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (value > 0 and math.isfinite(value)):
            rows.append(_row(WARN_ENV, WARN, f"{WARN_ENV}={raw!r} is not a finite number > 0: the mismatch "
                                             f"warning uses the default {DEFAULT_WARN_THRESHOLD}",
                             f"export {WARN_ENV}=1.05 (a finite token_mult_prob_error > 0), or unset it"))
    return rows


def activation_rows(config_path: Optional[str]) -> List[Dict[str, str]]:
    """Did `import npu_flashrl` activate from FLASHRL_CONFIG in this process (it runs before verify)?"""
    import npu_flashrl
    from npu_flashrl.config import ENV_CONFIG, ConfigError, lmhead_fp32_requested

    rows = []
    try:
        lmhead_fp32_requested()
    except ConfigError as exc:
        rows.append(_row("FLASHRL_LMHEAD_FP32", FAIL, str(exc), "export FLASHRL_LMHEAD_FP32=1 (or 0)"))
    rows += _switch_rows()
    error = getattr(npu_flashrl, "activation_error", None)
    if error:
        rows.append(_row("activation", FAIL, f"activation from {ENV_CONFIG} failed at import: {error}",
                         "fix the cause above; a rollout with this environment runs without npu_flashrl"))
    elif os.environ.get(ENV_CONFIG, "").strip() and not config_path \
            and os.environ.get("NPU_FLASHRL_NO_AUTOACTIVATE") != "1":
        rows.append(_row("activation", OK, f"activated from {ENV_CONFIG} at import"))
    return rows


def line_patches_row() -> Tuple[Dict[str, str], Optional[str]]:
    """(row, name) of the installed stack line (`npu_flashrl.lines`), naming the patches it
    brings; name None: no supported vllm-ascend."""
    from npu_flashrl import lines

    try:
        ln = lines.current()
    except lines.UnsupportedVersion as exc:
        return _row("vllm-ascend line", INFO, f"none: {exc}"), None
    return _row("vllm-ascend line", OK, f"{ln.describe()}, from {ln.source}; its patches: "
                f"{', '.join(ln.PATCHES)}"), ln.name


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
    row, installed = line_patches_row()
    rows = [row]
    for p in patches.status():
        check = f"patch {p['name']}"
        detail = f"{p['target']} [{p['versions']}]"
        if p.get("lines") and installed not in p["lines"]:
            rows.append(_row(check, INFO, f"n/a: not a patch of the installed line: {detail}"))
        elif p["name"] in crashed:
            error = crashed[p["name"]]
            fix = ("install the pinned torch_npu (scripts/install_pinned.sh --only torch_npu) and source "
                   "CANN's set_env.sh" if "torch_npu" in error or _torch_npu_import_error() else
                   "install the pinned version of the target (npu_flashrl/pins.yaml)")
            rows.append(_row(check, FAIL, f"applying it failed: {error} ({detail})", fix))
        elif p["applied"]:
            rows.append(_row(check, OK, f"applied in this process: {detail}"))
        elif p.get("pending"):
            rows.append(_row(check, INFO, f"pending: applied when {' and '.join(p['pending'])} is "
                             f"imported (this process has not imported it yet): {detail}"))
        elif p["error"]:
            required = p.get("required")
            rows.append(_row(check, FAIL if required else WARN,
                             f"not applied: {p['error']} ({detail})" + (
                                 "; an INT8 rollout depends on it: the engine build refuses" if required else ""),
                             "install the pinned version of the target (npu_flashrl/pins.yaml)"))
        else:
            rows.append(_row(check, INFO, f"registered, not applied in this process (the vLLM plugin "
                             f"applies it when FLASHRL_CONFIG is set; --apply-patches tries now): {detail}"))
    for module, callback, why in patches.CALLBACK_ERRORS:
        rows.append(_row(f"post-import {module}", WARN, f"{callback} failed {why}",
                         "install the pinned version of the target (npu_flashrl/pins.yaml)"))
    if len(rows) == 1:
        rows.append(_row("patches", INFO, "no patches registered"))
    return rows


def read_overrides(text: str) -> Tuple[List[str], Dict[str, str]]:
    """(Hydra overrides, environment assignments) of a verl command or an overrides file: one
    override per line or a recipe's ``--dry-run`` output (`npu_flashrl.recipes.command`: any
    ``verl.*`` entry point, ``VAR=... python3 -m`` and ``env VAR=...`` alike)."""
    from npu_flashrl.recipes.command import read_command

    cmd = read_command(text)
    return cmd.overrides, cmd.env


def verl_rows(path: str, verl: Optional[str] = None, config_path: Optional[str] = None) -> List[Dict[str, str]]:
    """Check verl overrides (file, or '-' for stdin) the way the verl line ``verl`` (None: the
    installed verl's, the pin's when verl is absent; see lines.verl_line) would run them. A
    FlashRL config in play (``config_path``, i.e. ``verify --config``, the command's ``env
    FLASHRL_CONFIG=``, the Ray runtime env's, or this shell's) makes it an INT8 rollout's check."""
    from npu_flashrl.adapters.verl import (RolloutModeError, TisConfigError, check_rollout_mode,
                                           overrides_to_config)
    from npu_flashrl.config import ENV_CONFIG

    label = f"verl overrides {path}"
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        return [_row(label, FAIL, f"cannot read: {exc.strerror or exc}",
                     "pass a file of Hydra overrides or '-' for stdin")]
    except UnicodeDecodeError as exc:
        return [_row(label, FAIL, f"not a text (UTF-8) file ({exc.reason} at byte {exc.start})",
                     "pass a recipe's --dry-run output or one Hydra override per line")]
    try:
        overrides, env = read_overrides(text)
    except ValueError as exc:  # shlex: an unclosed quote
        return [_row(label, FAIL, f"cannot split into words: {exc}",
                     "pass a recipe's --dry-run output or one Hydra override per line")]
    if not overrides:
        return [_row(label, FAIL, "no Hydra overrides (key=value) found",
                     "pass a recipe's --dry-run output or one override per line")]
    cfg = overrides_to_config(overrides)
    environ = dict(os.environ)
    environ.update(env)
    ray_env: object = cfg
    for part in ("ray_kwargs", "ray_init", "runtime_env", "env_vars"):
        ray_env = ray_env.get(part) if isinstance(ray_env, dict) else None
    in_command = env.get(ENV_CONFIG) or (ray_env.get(ENV_CONFIG) if isinstance(ray_env, dict) else None)
    if config_path and not in_command:
        environ[ENV_CONFIG] = config_path  # --config: this run's config, whatever this shell has
    elif in_command:
        environ[ENV_CONFIG] = str(in_command)
    try:
        warnings = check_rollout_mode(cfg, environ=environ, verl=verl)
    except (RolloutModeError, TisConfigError) as exc:
        msg, _, fix = str(exc).partition(" Fix: ")
        return [_row(label, FAIL, msg, fix)]
    from npu_flashrl import lines
    from npu_flashrl.recipes.command import read_command
    from npu_flashrl.recipes.preflight import check_command

    # the command's own environment and the FlashRL config in play; not this shell's (VLLM_PLUGINS,
    # VLLM_ASCEND_ENABLE_NZ here say nothing about the job's)
    job_env = {k: environ[k] for k in (ENV_CONFIG, "FLASHRL_LMHEAD_FP32") if k in environ}
    problems = check_command(read_command(text), lines.verl_line(verl), job_env)
    if problems:  # the recipes' rules: dtype, layout, server mode, checkpoint engines, MoE
        return [_row(label, FAIL, p) for p in problems]
    if warnings:
        return [_row(label, WARN, w) for w in warnings]
    return [_row(label, OK, f"{len(overrides)} overrides: rollout mode and TIS settings work at verl "
                 f"{lines.verl_line(verl)}")]


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
        rows += verl_rows(verl_overrides, config_path=config_path)
    rows += patch_rows(apply_patches)
    return rows


def kernel_conformance(as_json: bool = False, strict: bool = False) -> Tuple[str, bool]:
    """`verify --kernels`: (the report, passed) of `kernels.conformance` (its cases run on the
    NPU with a real torch_npu, else on the emulation). With `strict`, an op that accepts an input
    its Huawei page rejects fails too. A torch_npu that is present but fails to import is a FAIL
    row naming the import error and the fix (JSON under `as_json`), never a traceback."""
    from npu_flashrl.kernels import conformance

    broken = _torch_npu_import_error()
    if broken:
        rows = [{"op": "import torch_npu", "status": FAIL, "device": "npu",
                 "detail": f"`import torch_npu` fails: {broken}",
                 "fix": "reinstall the pinned torch_npu for this torch and source CANN's set_env.sh "
                        "(scripts/install_pinned.sh --only torch_npu)"}]
        ok = False
    else:
        rows = conformance.run()
        ok = not conformance.failed(rows) and not (
            strict and any(r["status"] == conformance.ACCEPTS_INVALID for r in rows))
    if as_json:
        return json.dumps({"ok": ok, "strict": bool(strict), "rows": rows}, indent=2), ok
    text = conformance.format_rows(rows)
    fixes = [f"fix: {r['fix']}" for r in rows if r.get("fix")]
    return "\n".join([text] + fixes), ok


def failing_rows(rows: List[Dict[str, str]], strict: bool = False) -> List[Dict[str, str]]:
    """The rows that make `npu-flashrl verify` fail: FAIL, and with `strict` WARN too."""
    return [r for r in rows if r["status"] == FAIL or (strict and r["status"] == WARN)]


def format_table(rows: List[Dict[str, str]]) -> str:
    w1 = max(len(r["check"]) for r in rows)
    w2 = max([len("STATUS")] + [len(r["status"]) for r in rows])
    lines = [f"{'CHECK'.ljust(w1)}  {'STATUS'.ljust(w2)}  DETAIL", "-" * (w1 + w2 + 12)]
    for r in rows:
        lines.append(f"{r['check'].ljust(w1)}  {r['status'].ljust(w2)}  {r['detail']}")
        if r["fix"] and r["status"] in (FAIL, WARN):
            lines.append(f"{''.ljust(w1)}  {''.ljust(w2)}  fix: {r['fix']}")
    return "\n".join(lines)
