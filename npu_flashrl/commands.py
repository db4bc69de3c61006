"""What `npu-flashrl profile / setup / cleanup` do, as library functions.

Each takes plain arguments, returns what it did and raises `CliError` (message naming the flag and
the fix, plus the command's exit code: 2 bad usage, 1 a failed check) on bad input; nothing is
printed. `npu_flashrl.cli` parses the command line, calls these and prints; the rehearsal and
users' scripts call them directly. (`npu-flashrl verify`'s checks are in `npu_flashrl.verify`.)
"""
from __future__ import annotations

import ast
import contextlib
import os
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import yaml

from npu_flashrl._logging import get_logger
from npu_flashrl.errors import CliError

logger = get_logger(__name__)

DEFAULT_CONFIG_OUTPUT = os.path.join("~", ".flashrl_config.yaml")  # FlashRL's default


# ============================================================================ profile

def write_profile(model: Optional[str], quantized: str, output: str, fn: str = "int8",
                  progress: bool = True) -> Dict[str, dict]:
    """FlashRL's int8 profile of the bf16 checkpoint `model` against the W8A8 one `quantized`,
    written to `output` (`npu-flashrl profile`); returns the profile."""
    from npu_flashrl.profile import make_profile

    if fn != "int8":
        raise CliError(f"--fn {fn}: FP8 profiles are not supported: Ascend 910B (Atlas A2) has no FP8 "
                       "matmul; use --fn int8", code=2)
    if not model:
        raise CliError("--fn int8 needs the original bf16 checkpoint: -m BF16_DIR", code=2)
    _refuse_overwriting_a_checkpoint_file(output, (model, quantized))
    return make_profile(model, quantized, output, fn=fn, progress=progress)


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
    """The `key=value` words as {key: value}; a key given twice with different values is refused
    naming both words (the last one would win without a word)."""
    out: Dict[str, Any] = {}
    words: Dict[str, str] = {}
    for column in columns:
        if column == "--":
            continue
        key, sep, value = column.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "a").isalnum():
            raise CliError(f"bad argument {column!r}: expected key=value "
                           f"(e.g. module_attribute_to_preserve='[\"workspace\"]')", code=2)
        parsed = parse_value(value)
        if key in out and out[key] != parsed:
            raise CliError(f"{words[key]!r} and {column!r}: two values for the entry's `{key}`; give it once",
                           code=2)
        out[key] = parsed
        words.setdefault(key, column)
    return out


# The entry keys that have a flag of their own: a key=value word must not contradict the flag.
_FLAG_OF_KEY = {"fn": "--fn", "model": "-m", "profile": "-p"}


def _same_value(key: str, flag_value: str, word_value: Any) -> bool:
    from npu_flashrl.config import FN_ALIASES

    if not isinstance(word_value, str):
        return False
    if key == "fn":
        a, b = flag_value.strip(), word_value.strip()
        return FN_ALIASES.get(a, a) == FN_ALIASES.get(b, b)
    return _local_path(flag_value) == _local_path(word_value)


def _local_path(path: str) -> str:
    """`path` absolute when it names something on this machine (it exists, or is written as a local
    path: absolute, ./, ../ or ~); else as given (a hub id, or a path only the cluster has, with
    --no-check). The config is read by processes in other working directories (vLLM workers, Ray
    actors, `verify` run elsewhere), so a relative path would name another file there."""
    text = path.strip()
    expanded = os.path.expanduser(text)
    if os.path.isabs(expanded) or os.path.exists(expanded) or text.startswith(("./", "../", "~")) \
            or text in (".", ".."):
        return os.path.abspath(expanded)
    return path


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


def _check_description(entry) -> None:
    """An INT8 entry's checkpoint: its quant description per layer (ModelSlim) or per group
    (compressed-tensors) against the scheme registry and its own tensors, as the engine build
    would read it (`description_check`); refused by layer / group name, nothing written."""
    from npu_flashrl.adapters.vllm_ascend.description_check import description_problems
    from npu_flashrl.config import FN_BF16

    if entry.fn == FN_BF16:
        return  # npu_flashrl stays out of a bf16 rollout's engine
    problems, notes = description_problems(entry.model)
    for note in notes:
        logger.warning("setup -m %s: %s", entry.model, note)
    if problems:
        raise CliError(f"-m {entry.model}: the engine would refuse or misrun this checkpoint:\n  "
                       + "\n  ".join(problems) + "\nnothing written")


def _check_w8a8(model: str) -> None:
    from npu_flashrl.profile import MOE_FIX, check_w8a8_checkpoint, corrupt_scale_problems, moe_profile_problem
    from npu_flashrl.verify_config import W8A8_FIX

    moe = moe_profile_problem(model)
    if moe:
        raise CliError(f"--fn int8 -m {model}: {moe}\nfix: {MOE_FIX}")
    problems = check_w8a8_checkpoint(model)
    if problems:
        raise CliError(f"--fn int8 -m {model}: " + "; ".join(problems) + f"\nfix: {W8A8_FIX}")
    problems = corrupt_scale_problems(model)
    if problems:
        raise CliError(f"--fn int8 -m {model}: " + "; ".join(problems))


def _check_w4a8(entry) -> None:
    """A W4A8 entry's checkpoint: its layers and group size (`w4a8_checkpoint`)."""
    from npu_flashrl.w4a8_checkpoint import applies, mixed_layout, w4a8_checkpoint_problems

    if not applies(entry):
        return
    problems = w4a8_checkpoint_problems(entry.model, entry.group_size)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CliError(f"--fn {entry.fn} -m {entry.model}: {problems[0]}{more}")
    mixed = mixed_layout(entry.model)
    if mixed:
        logger.info("setup -m %s: %s", entry.model, mixed)


def build_entry(fn: Optional[str], model: Optional[str], profile: Optional[str], columns: Dict[str, Any],
                check: bool = True, allow_unknown_keys: bool = False):
    """The config entry `setup` writes, validated (profile vs model when check). `fn` None: not
    given (a `fn=` word, else int8). `model` and `profile` are written absolute when they are
    local paths (`_local_path`)."""
    from npu_flashrl.config import FN_INT8, ConfigError, RolloutConfig, needs_profile, unknown_key_problems
    from npu_flashrl.profile import ProfileError, check_profile_against_model, load_profile

    given = {"fn": fn, "model": model, "profile": profile}
    for key, flag in _FLAG_OF_KEY.items():
        if given[key] is not None and key in columns and not _same_value(key, given[key], columns[key]):
            raise CliError(f"{flag} {given[key]} and {key}={columns[key]}: two values for the entry's `{key}`; "
                           f"give it once (drop {key}=... or {flag})", code=2)
    if fn is None:
        fn = columns["fn"] if isinstance(columns.get("fn"), str) else FN_INT8
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
    if entry.profile is not None and not needs_profile(entry):
        shown = f"-p {profile}" if profile is not None else f"profile={entry.profile}"
        raise CliError(f"{shown}: only --fn int8 uses a profile (fn {entry.fn} would ignore it); drop it", code=2)
    for key in ("model", "profile"):
        if getattr(entry, key):
            setattr(entry, key, _local_path(getattr(entry, key)))
    if needs_profile(entry) and not entry.model:
        raise CliError(f"--fn {entry.fn} needs -m MODEL (the W8A8 checkpoint dir)", code=2)
    if needs_profile(entry) and str(entry.load_format).lower() == "dummy":
        raise CliError(f"load_format=dummy with --fn {entry.fn}: the W8A8 model would keep random "
                       "weight_scale tensors that no weight sync replaces; drop it (setup writes "
                       "load_format: auto)", code=2)
    if check:
        if entry.model:
            _check_model_dir(entry.model)
            _check_w4a8(entry)
        if needs_profile(entry):
            _check_w8a8(entry.model)  # a ModelSlim checkpoint is refused for fn int8 first
        if entry.model:
            _check_description(entry)
        if needs_profile(entry):
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


def setup(fn: Optional[str] = None, model: Optional[str] = None, profile: Optional[str] = None,
          output: Optional[str] = None, append: bool = False, check: bool = True, force: bool = False,
          columns: Iterable[str] = ()):
    """Write (or with `append`, extend) the FlashRL config at `output` (default
    `DEFAULT_CONFIG_OUTPUT`) with one entry (`npu-flashrl setup`); `fn` None: a `fn=` column, else
    int8; `columns`: extra `key=value` entry keys (refused when they contradict a flag). Everything about `output` is checked before the model is read. Returns the
    written `FlashRLConfig` (its `path` is where)."""
    from npu_flashrl.checkpoint import architecture_mismatch
    from npu_flashrl.config import ConfigError, FlashRLConfig, load_config, output_path_problem, write_config

    output = os.path.expanduser(output or DEFAULT_CONFIG_OUTPUT)
    # everything about -o first: the profile check below reads the whole model
    problem = output_path_problem(output)
    if problem:
        raise CliError(f"-o {problem}")
    if append and not os.path.exists(output):
        raise CliError(f"-a: {output} does not exist, nothing to append to (drop -a to create it)")
    if append:  # read again under the lock below; this finds a bad file before any work
        try:
            load_config(output)
        except ConfigError as exc:
            raise CliError(f"-a: the existing config cannot be appended to: {exc}") from None
    elif os.path.exists(output) and not force:
        try:
            load_config(output)
        except ConfigError as exc:
            raise CliError(f"-o {output}: exists and is not a FlashRL config, not replaced ({exc}); "
                           f"pass --force to replace it") from None
    entry = build_entry(fn, model, profile, parse_columns(list(columns)), check=check, allow_unknown_keys=force)
    if model and os.path.isdir(model):
        from npu_flashrl.architectures import line_refusal, model_architecture, warn_if_not_covered

        arch = model_architecture(model)
        if arch:
            from npu_flashrl.config import FN_BF16

            why = line_refusal(arch) if entry.fn != FN_BF16 else None
            if why:
                raise CliError(f"-m {model}: {why}; nothing written")
            warn_if_not_covered(arch, f"setup -m {model}")
    try:
        if append:
            with _locked_config(output, "-a", "nothing appended (drop -a to create it)"):
                # read-modify-write under the lock: concurrent -a keep every entry, cleanup -p waits
                try:
                    cfg = load_config(output)
                except ConfigError as exc:
                    raise CliError(f"-a: the existing config cannot be appended to: {exc}") from None
                cfg.entries.append(entry)
                mismatch = architecture_mismatch([(f"configs[{i}]", e.model) for i, e in enumerate(cfg.entries)
                                                  if e.model and os.path.isdir(e.model)])
                if mismatch and check:
                    raise CliError(f"-a {output}: the new entry {mismatch}; not appended")
                write_config(cfg, output)
        else:
            cfg = FlashRLConfig(entries=[entry], path=output)
            write_config(cfg, output)
    except OSError as exc:
        raise CliError(f"-o {output}: cannot write: {exc.strerror or exc} (nothing changed)") from None
    cfg.path = output
    return cfg


@contextlib.contextmanager
def _locked_config(path: str, flag: str, outcome: str) -> Iterator[None]:
    """config.locked_file on an existing config, for setup -a and cleanup -p (the one lock both
    take, so a removal never races an append); its removal meanwhile is a CliError naming it."""
    from npu_flashrl.config import locked_file

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locked_file(path))
        except FileNotFoundError:
            raise CliError(f"{flag} {path}: no longer exists (removed while waiting for its lock, e.g. by "
                           f"`npu-flashrl cleanup -p`); {outcome}") from None
        yield


# ============================================================================ cleanup

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


def cleanup(config: Optional[str] = None, site_dirs: Optional[Sequence[str]] = None,
            dry_run: bool = False) -> List[str]:
    """Undo setup (`npu-flashrl cleanup`): FlashRL's usercustomize.py import lines commented out in
    `site_dirs` (default: every site-packages dir), the config file `config` removed (only if it is
    a FlashRL config). Returns what was (or with `dry_run`, would be) done."""
    from npu_flashrl.adapters.flashrl import site_packages_dirs, usercustomize_files
    from npu_flashrl.config import ConfigError, load_config

    dirs = site_dirs if site_dirs else site_packages_dirs()
    notes: List[str] = []
    for path in usercustomize_files(dirs):
        notes += disable_usercustomize(path, dry_run=dry_run)
    if config:
        if not os.path.exists(config):
            notes.append(f"{config}: no such config (nothing to remove)")
        else:
            try:
                load_config(config)  # first without the lock: a FIFO or a foreign file is refused unopened
            except ConfigError as exc:
                raise CliError(f"-p {config}: not removed, it is not a FlashRL config ({exc})") from None
            if not dry_run:
                # setup -a's lock: an append in progress finishes first, and none starts until the
                # file is gone (else its write would bring the file back after "removed")
                with _locked_config(config, "-p", "nothing removed"):
                    try:
                        load_config(config)
                    except ConfigError as exc:
                        raise CliError(f"-p {config}: not removed, it is not a FlashRL config ({exc})") from None
                    try:
                        os.remove(config)
                    except OSError as exc:
                        raise CliError(f"-p {config}: cannot remove: {exc.strerror or exc}") from None
            notes.append(f"{'would remove' if dry_run else 'removed'} config {config}")
    if os.environ.get("FLASHRL_CONFIG"):
        notes.append(f"FLASHRL_CONFIG={os.environ['FLASHRL_CONFIG']} is still set in this shell: "
                     f"unset FLASHRL_CONFIG")
    return notes
