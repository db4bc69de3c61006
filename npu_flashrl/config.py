"""FlashRL-compatible rollout configuration (the YAML that `FLASHRL_CONFIG` points at).

Schema (FlashRL 1.0.3, `flash_rl/configs/*.py` and `flash_rl/commands.py`)::

    configs:
      - fn: int8                      # quantization function
        load_format: auto             # overrides vllm.LLM(load_format=...)
        distributed_executor_backend: external_launcher
        model: /path/to/w8a8          # optional: replaces the model passed to vllm.LLM
        profile: /path/to/profile.pt  # optional: default <model>/profile.pt
        quantization: ...             # optional: overrides vllm.LLM(quantization=...)
        # any other key is kept (FlashRL: module_attribute_to_preserve, ...)
      - fn: bf16                      # hybrid: entry dp_rank % len(configs) per DP group
        load_format: dummy
        distributed_executor_backend: external_launcher

FlashRL semantics kept: a missing `fn` means `int8`; `FLASHRL_CONFIG` may be a shortcut name
instead of a path (FlashRL: bf16 and the fp8 family; here bf16 and int8_profile_free, the fp8 ones are
refused); with several entries worker DP group `RANK // (tp * pp)` uses `configs[dp_rank % n]`.

fn values: `int8` (FlashRL's profile-based online INT8), `int8_profile_free` (ours: per-channel
weight scales recomputed at every weight sync, no profile), `w4a8_profile_free` (ours: vllm-ascend's
W4A8_DYNAMIC layers, int4 weights in groups of `group_size` input channels, default 256, 0 for
per-channel fused-MoE experts of a ModelSlim checkpoint; the only fn that takes `group_size`;
docs/w4a8.md), `bf16` (unquantized). FlashRL's
`int8_wo_prune` is `int8` in 1.0.3 (same default config, same quantize function); `int8_fast` is
`int8` with a CUDA-specific reload shortcut (skips CompressedTensorsW8A8Int8 post-processing), so on
Ascend it is `int8` too. `int8_prune` (zeroes layernorm channels whose columns are zero in every
int8 consumer; needs the whole state dict in one call) and the fp8 family are refused.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Union

import yaml

from npu_flashrl._files import special_file_problem
from npu_flashrl._logging import get_logger
from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.quant import wire as _wire
from npu_flashrl.quant.registry import names as _quantizer_names

logger = get_logger(__name__)

ENV_CONFIG = "FLASHRL_CONFIG"
EXTERNAL_LAUNCHER = "external_launcher"


ENV_LMHEAD_FP32 = "FLASHRL_LMHEAD_FP32"
_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f", "")


def lmhead_fp32_requested(environ=None) -> bool:
    """FLASHRL_LMHEAD_FP32 (FlashRL's switch and meaning: '1' is on); the one parser every side uses.

    The usual true/false spellings are accepted (FlashRL only knows '1': `yes` there is silently
    off); anything else raises ConfigError naming the variable, never a silent off.
    """
    env = os.environ if environ is None else environ
    value = str(env.get(ENV_LMHEAD_FP32, "0"))
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{ENV_LMHEAD_FP32}={value!r}: expected 1 or 0 (also true/false, yes/no, on/off)")

FN_INT8 = "int8"
FN_INT8_PROFILE_FREE = "int8_profile_free"
FN_BF16 = "bf16"
# The online INT8 functions are the quantizer registry's names; bf16 is "no quantizer".
SUPPORTED_FNS = _quantizer_names() + (FN_BF16,)

# FlashRL 1.0.3 names that mean one of ours.
FN_ALIASES = {
    "int8_wo_prune": FN_INT8,   # identical to int8 in 1.0.3 (Int8Config, flash_quantize)
    "int8_fast": FN_INT8,       # int8 math; "fast" only changes FlashRL's CUDA reload path
}
_FP8_FNS = ("fp8", "fp8_vllm", "fp8_fast", "fp8_vllm_fast", "fp8_channel", "fp8_tensor")
REFUSED_FNS = {
    **{fn: ("Ascend 910B (Atlas A2) has no FP8 matmul; use fn=int8 (with a profile) or "
            "fn=int8_profile_free" ) for fn in _FP8_FNS},
    "int8_prune": ("FlashRL's int8_prune (dead-neuron pruning of layernorm channels) needs the whole "
                   "state dict in one call and changes the model's numerics; it is not supported: "
                   "use fn=int8"),
}
ALL_FLASHRL_FNS = SUPPORTED_FNS + tuple(FN_ALIASES) + tuple(REFUSED_FNS)

# Defaults per fn, as FlashRL's dataclasses (bf16 keeps FlashRL's load_format=dummy: verl's sync
# rollout builds the engine with dummy weights and then syncs the real ones).
_DEFAULTS: Dict[str, Dict[str, Any]] = {
    FN_INT8: {"load_format": "auto", "distributed_executor_backend": EXTERNAL_LAUNCHER},
    FN_INT8_PROFILE_FREE: {"load_format": "auto", "distributed_executor_backend": EXTERNAL_LAUNCHER},
    FN_BF16: {"load_format": "dummy", "distributed_executor_backend": EXTERNAL_LAUNCHER},
}
# Shortcut values of FLASHRL_CONFIG that need no file.
SHORTCUTS = (FN_BF16, FN_INT8_PROFILE_FREE)

_KNOWN_KEYS = ("fn", "model", "profile", "load_format", "quantization", "distributed_executor_backend",
               "wire")
# Keys whose value is an integer, not a string: `group_size` (input channels per scale group of a
# quantizer with groups: fn w4a8_profile_free; default its quantizer's, 256; 0: per-channel).
_INT_KEYS = ("group_size",)
# `wire`: what the trainer sends at a weight sync (npu_flashrl.quant.wire, the one home of these
# names): "float" (default, the trainer's dtype) or "int8" (projections quantized on the trainer,
# W8A8_DYNAMIC names).
WIRES = _wire.WIRES
# Keys FlashRL 1.0.3 reads besides ours: kept in `extra` and written back untouched.
FLASHRL_EXTRA_KEYS = ("module_attribute_to_preserve",)


def unknown_key_problems(entry: "RolloutConfig", where: str = "entry") -> List[str]:
    """One line per key of `entry` that neither we nor FlashRL read (a typo is otherwise kept and
    silently ignored at run time), with the closest known key."""
    import difflib

    known = _KNOWN_KEYS + _INT_KEYS + FLASHRL_EXTRA_KEYS
    out = []
    for key in entry.extra:
        if key in FLASHRL_EXTRA_KEYS:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        out.append(f"{where}: unknown key {key!r} (ignored at run time; {hint})")
    return out


class ConfigError(NpuFlashrlError, ValueError):
    """A FlashRL config that cannot be used; the message names the file/key and what was expected."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently: `fn: int8` then `fn: bf16` would run bf16). Raises yaml.constructor.ConstructorError
    with both lines. Merge keys (`<<: *base`) work as in yaml.safe_load (FlashRL's reader): a key of
    the mapping itself overrides a merged one, which is what a merge is for, not a duplicate."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: Dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue  # merged by SafeLoader (flatten_mapping) below
                try:
                    key = self.construct_object(key_node, deep=True)
                    hash(key)
                except TypeError:
                    continue  # an unhashable key: SafeLoader's own error follows
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first at line {seen[key].line + 1}; YAML would keep only "
                        f"the last value)", key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml_unique(stream: Any) -> Any:
    """yaml.safe_load, refusing duplicate keys (UniqueKeyLoader). Nesting deeper than PyYAML's
    recursive composer can follow is a yaml.YAMLError saying so (not a RecursionError)."""
    try:
        return yaml.load(stream, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError(f"nested too deeply for the YAML reader (Python's recursion limit is "
                             f"{sys.getrecursionlimit()}); a FlashRL config is a few levels deep") from None


def normalize_fn(fn: Any, where: str = "fn") -> str:
    """Map a FlashRL fn name to ours, or raise ConfigError saying why it is refused."""
    if not isinstance(fn, str):
        raise ConfigError(f"{where}: expected a string, one of {', '.join(SUPPORTED_FNS)}; got {fn!r}")
    name = fn.strip()
    if name in SUPPORTED_FNS:
        return name
    if name in FN_ALIASES:
        logger.info("fn=%s is FlashRL's name for %s here", name, FN_ALIASES[name])
        return FN_ALIASES[name]
    if name in REFUSED_FNS:
        raise ConfigError(f"{where}: fn={name!r} is not supported on Ascend: {REFUSED_FNS[name]}")
    raise ConfigError(f"{where}: unknown fn {name!r}; expected one of {', '.join(SUPPORTED_FNS)} "
                      f"(FlashRL aliases: {', '.join(FN_ALIASES)})")


@dataclasses.dataclass
class RolloutConfig:
    """One entry of `configs:`."""
    fn: str = FN_INT8
    model: Optional[str] = None
    profile: Optional[str] = None
    load_format: Optional[str] = None
    quantization: Optional[str] = None
    distributed_executor_backend: Optional[str] = EXTERNAL_LAUNCHER
    wire: Optional[str] = None
    group_size: Optional[int] = None  # None: the quantizer's default (or the checkpoint's own)
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def default(cls, fn: str) -> "RolloutConfig":
        fn = normalize_fn(fn)
        # a registered quantizer without a row of its own (w4a8_profile_free) loads as the online INT8 fns do
        return cls(fn=fn, **_DEFAULTS.get(fn, _DEFAULTS[FN_INT8_PROFILE_FREE]))

    @classmethod
    def from_dict(cls, data: Any, where: str = "configs[0]") -> "RolloutConfig":
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping with at least `fn`; got {type(data).__name__}")
        fn = normalize_fn(data.get("fn", FN_INT8), f"{where}.fn")  # FlashRL: missing fn = int8
        # Like FlashRL, only keys present in the file override vllm.LLM's kwargs: no defaults here.
        kwargs: Dict[str, Any] = {"distributed_executor_backend": None}
        for key in _KNOWN_KEYS[1:]:
            if key in data:
                value = data[key]
                if value is not None and not isinstance(value, str):
                    raise ConfigError(f"{where}.{key}: expected a string; got {value!r}")
                kwargs[key] = value
        if "group_size" in data and data["group_size"] is not None:
            kwargs["group_size"] = _check_group_size(fn, data["group_size"], where)
        extra = {k: v for k, v in data.items() if k not in _KNOWN_KEYS + _INT_KEYS}
        for k in extra:
            if not isinstance(k, str):
                raise ConfigError(f"{where}: keys must be strings; got {k!r}")
        _check_wire(fn, kwargs.get("wire"), where)
        _check_quantization(fn, kwargs.get("quantization"), where)
        return cls(fn=fn, extra=extra, **kwargs)

    def to_dict(self) -> Dict[str, Any]:
        """FlashRL's YAML form of this entry (None fields left out, extra keys kept)."""
        out: Dict[str, Any] = {"fn": self.fn}
        for key in _KNOWN_KEYS[1:] + _INT_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out.update(self.extra)
        return out

    def profile_path(self, model: Optional[str] = None) -> Optional[str]:
        """The profile to load (FlashRL: `profile`, else `<model>/profile.pt`); None when not int8."""
        if self.fn != FN_INT8:
            return None
        if self.profile:
            return self.profile.strip()
        base = self.model or model
        return os.path.join(base, "profile.pt") if base else None


@dataclasses.dataclass
class FlashRLConfig:
    entries: List[RolloutConfig]
    path: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"configs": [e.to_dict() for e in self.entries]}


def _check_wire(fn: str, wire: Optional[str], where: str) -> None:
    if wire is None:
        return
    if wire.strip() not in WIRES:
        raise ConfigError(f"{where}.wire: expected one of {', '.join(WIRES)}; got {wire!r}")
    if wire.strip() == _wire.WIRE_INT8 and fn != FN_INT8_PROFILE_FREE:
        why = {FN_INT8: "FlashRL's int8 profile (fixed, profiled scales) lives on the rollout only, so the "
                        "trainer cannot quantize as the rollout does",
               FN_BF16: "a bf16 rollout takes full-precision weights"}.get(
            fn, f"the INT8 wire carries per-channel int8 weights (W8A8_DYNAMIC), which the layers of fn {fn!r} "
                "do not hold; that rollout quantizes the float weights itself at every sync (the float wire)")
        raise ConfigError(f"{where}.wire: int8 needs fn {FN_INT8_PROFILE_FREE}, not fn {fn!r}: {why}. "
                          "Drop `wire: int8` or use fn int8_profile_free")


def _check_quantization(fn: str, value: Optional[str], where: str) -> None:
    """`quantization` on an entry whose quantizer builds its own vllm-ascend layers from a bf16
    checkpoint (W4A8: `description_type` not W8A8_DYNAMIC): the engine build sets 'ascend' for every
    quantized entry, so another value would be overwritten without a word. (The INT8 fns keep
    FlashRL's key: their compressed-tensors checkpoint is read by vllm-ascend either way.)"""
    from npu_flashrl.quant.registry import QUANTIZERS

    cls = QUANTIZERS.get(fn)
    if value is None or cls is None or cls.description_type == "W8A8_DYNAMIC" or value.strip() == "ascend":
        return
    raise ConfigError(f"{where}.quantization: {value!r} with fn {fn!r}: that rollout runs vllm-ascend's "
                      f"{cls.description_type} layers (quantization 'ascend', set by npu_flashrl at the engine "
                      "build), so the key would be overwritten; drop it (or set it to ascend)")


def _check_group_size(fn: str, value: Any, where: str) -> int:
    """The entry's `group_size`: only for a quantizer with weight groups, a positive integer."""
    from npu_flashrl.quant.registry import QUANTIZERS

    cls = QUANTIZERS.get(fn)
    if cls is None or cls.default_group_size is None:
        grouped = [n for n, c in QUANTIZERS.items() if c.default_group_size is not None]
        raise ConfigError(f"{where}.group_size: fn {fn!r} has no weight groups; the key applies to "
                          f"fn {', '.join(grouped)} only (drop it, or use that fn)")
    from npu_flashrl.quant.w4a8 import group_size_problem

    problem = group_size_problem(value, f"{where}.group_size")
    if problem:
        raise ConfigError(problem)
    return value


def group_size_of(entry: "RolloutConfig") -> Optional[int]:
    """The group size the entry's rollout layers are built with from a bf16 checkpoint (its key,
    else its quantizer's default); None for an fn without weight groups."""
    from npu_flashrl.quant.registry import QUANTIZERS

    cls = QUANTIZERS.get(entry.fn)
    if cls is None or cls.default_group_size is None:
        return None
    return entry.group_size if entry.group_size is not None else cls.default_group_size


def wire_of(cfg: "FlashRLConfig") -> str:
    """What the trainer sends: one stream reaches every replica, so every entry must agree."""
    wires = {(e.wire or _wire.WIRE_FLOAT).strip() for e in cfg.entries}
    if len(wires) > 1:
        raise ConfigError(f"{cfg.path or '<config>'}: entries disagree on `wire` ({sorted(wires)}); "
                          "the trainer sends one stream to every rollout replica, so a hybrid "
                          "config cannot mix an INT8 wire with a float one")
    return wires.pop()


def is_quantized(entry: RolloutConfig) -> bool:
    return entry.fn != FN_BF16


def needs_profile(entry: RolloutConfig) -> bool:
    return entry.fn == FN_INT8


def int8_rollout_dtype_problem(dtype: Any) -> Optional[str]:
    """Why an INT8 rollout cannot run in `dtype` (None: it can). float16 is refused: vllm-ascend's
    W8A8_DYNAMIC linear passes its weight scale in the model dtype to torch_npu.npu_quant_matmul
    with a per-token scale, and the op documents only a float32 scale for a float16 output with
    a per-token scale (and no float16 bias); see docs/compatibility.md, "Emulated torch_npu ops"."""
    name = str(dtype).replace("torch.", "").lower() if dtype is not None else ""
    if name in ("float16", "fp16", "half"):
        return ("an INT8 rollout cannot run in float16: vllm-ascend's W8A8_DYNAMIC layers call "
                "torch_npu.npu_quant_matmul with a float16 weight scale and a per-token scale, which "
                "the op does not accept (a float16 output with a per-token scale needs a float32 "
                "scale). Use dtype bfloat16 for the rollout")
    return None


def parse_config(data: Any, source: str = "<config>") -> FlashRLConfig:
    """Validate a loaded YAML document (FlashRL schema)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping with key `configs` (a list of entries); "
                          f"got {type(data).__name__}")
    if "configs" not in data:
        raise ConfigError(f"{source}: missing key `configs` (expected `configs: [{{fn: int8, ...}}, ...]`); "
                          f"found keys {sorted(map(str, data))}")
    items = data["configs"]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{source}: key `configs` must be a non-empty list of entries; got {items!r}")
    entries = [RolloutConfig.from_dict(item, f"{source}: configs[{i}]") for i, item in enumerate(items)]
    cfg = FlashRLConfig(entries=entries, path=None if source.startswith("<") else source)
    wire_of(cfg)  # a hybrid config mixing wires is refused here, naming the file
    return cfg


def load_config(path_or_none: Optional[Union[str, os.PathLike]] = None) -> FlashRLConfig:
    """Load a FlashRL config: a YAML path, or a shortcut name (bf16, int8_profile_free).

    None reads `FLASHRL_CONFIG`. Raises ConfigError naming the file (and key) on any problem.
    """
    from_env = path_or_none is None
    if from_env:
        value = os.environ.get(ENV_CONFIG)
        if value is None or not value.strip():
            raise ConfigError(f"{ENV_CONFIG} is not set; set it to a FlashRL config YAML "
                              f"(npu-flashrl setup -o FILE) or to one of {', '.join(SHORTCUTS)}")
        origin = f"{ENV_CONFIG}={value!r}"
    else:
        value = os.fspath(path_or_none)
        origin = repr(value)
    value = value.strip()

    if value in SHORTCUTS:
        logger.info("Using the profile-free default config for %s", value)
        return FlashRLConfig(entries=[RolloutConfig.default(value)], path=None)
    try:
        os.stat(value)
        exists = True
    except PermissionError as exc:  # a dir on the way is not searchable: not "no such file"
        raise ConfigError(f"{origin}: cannot access: {exc.strerror} (check the permissions of its "
                          f"directories)") from exc
    except OSError:
        exists = False
    if not exists:
        if value in REFUSED_FNS:
            normalize_fn(value, origin)
        if value in (FN_INT8, *FN_ALIASES):
            raise ConfigError(f"{origin}: fn {value!r} needs a model and a profile, so it cannot be a "
                              f"shortcut; write a config with `npu-flashrl setup -m MODEL -p PROFILE "
                              f"--fn {value} -o FILE`")
        if value in SUPPORTED_FNS:  # a quantizer with weight groups: its group size is the model's
            raise ConfigError(f"{origin}: fn {value!r} is not a shortcut (its group size must divide the "
                              f"model's projections, which setup checks); write a config with `npu-flashrl "
                              f"setup -m MODEL --fn {value} -o FILE [group_size=N]`")
        hint = ""
        if value.count("/") >= 2 and not value.startswith(("/", ".", "~")):
            hint = (" (FlashRL would fetch a hub path `org/repo/file`; npu_flashrl does not download: "
                    "fetch the file yourself and point at the local copy)")
        raise ConfigError(f"{origin}: no such file, and not a shortcut name ({', '.join(SHORTCUTS)}){hint}")
    if os.path.isdir(value):
        raise ConfigError(f"{origin}: is a directory; expected a FlashRL config YAML file")
    special = special_file_problem(value)
    if special:  # before opening: every vLLM worker and Ray hook reading it would hang
        raise ConfigError(f"{origin}: {special} (a FlashRL config YAML)")
    try:
        with open(value, "r") as f:
            data = load_yaml_unique(f)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{value}: not a text (UTF-8) YAML file ({exc.reason} at byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{value}:{where} malformed YAML: {getattr(exc, 'problem', None) or exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{value}: cannot read: {exc.strerror or exc} (the file exists; check its "
                          f"permissions)") from exc
    cfg = parse_config(data, value)
    cfg.path = value
    for i, entry in enumerate(cfg.entries):
        for problem in unknown_key_problems(entry, f"{value}: configs[{i}]"):
            logger.warning("%s", problem)
    return cfg


def select_entry(cfg: FlashRLConfig, dp_rank: int) -> RolloutConfig:
    """FlashRL hybrid rule: DP group `dp_rank` uses `configs[dp_rank % len(configs)]`."""
    if not cfg.entries:
        raise ConfigError(f"{cfg.path or '<config>'}: `configs` is empty")
    if dp_rank < 0:
        raise ValueError(f"dp_rank must be >= 0; got {dp_rank}")
    return cfg.entries[dp_rank % len(cfg.entries)]


def dp_rank_from_env(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                     env: Optional[Mapping[str, str]] = None) -> int:
    """FlashRL's `RANK // (tp * pp)` (global rank of an external_launcher worker)."""
    env = os.environ if env is None else env
    if "RANK" not in env:
        raise ConfigError("RANK is not set: FlashRL-style configs need the external_launcher "
                          "environment (RANK, WORLD_SIZE) to pick an entry per DP group")
    try:
        rank = int(env["RANK"])
    except ValueError:
        raise ConfigError(f"RANK={env['RANK']!r} is not an integer") from None
    mp = int(tensor_parallel_size or 1) * int(pipeline_parallel_size or 1)
    if mp <= 0:
        raise ValueError(f"tp*pp must be positive; got {mp}")
    return rank // mp


def write_target(path: Union[str, os.PathLike]) -> str:
    """The file atomic_write replaces for `path`: `path` itself, or for a symlink the file it points
    to (written through: the link stays a link, and its target gets the new content)."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else path


def output_path_problem(path: Union[str, os.PathLike]) -> Optional[str]:
    """Why `path` cannot be written by atomic_write (None when it can), found before any expensive
    work: a directory, a parent that is not a directory, or a directory we cannot create files in.
    A symlink is checked as the file it points to (atomic_write writes through it)."""
    shown = os.fspath(path)
    if shown != shown.strip():  # not stripped here: that would write a file the user did not name
        return (f"{shown!r}: the path starts or ends with whitespace; FLASHRL_CONFIG and the config's "
                f"paths are read stripped, so the file would not be found: give the path without it")
    path = write_target(shown)
    if path != shown:
        shown = f"{shown} (a symlink to {path})"
    if os.path.isdir(path):
        return f"{shown}: is a directory; expected a file path"
    if os.path.exists(path) and not os.path.isfile(path):
        return f"{shown}: exists and is not a regular file"
    if os.path.isfile(path) and not os.access(path, os.W_OK):  # os.replace would swap it anyway
        mode = f"mode {stat.S_IMODE(os.stat(path).st_mode):04o}"
        if not os.access(path, os.R_OK):
            return f"{shown}: exists and we cannot read or write it ({mode}: check its permissions), not replaced"
        return (f"{shown}: exists and is read-only ({mode}), not replaced: make it writable (chmod u+w) "
                f"or write elsewhere")
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(probe):  # atomic_write creates missing parents
        if os.path.islink(probe):  # exists() is False through a dangling link or a loop of links
            try:
                os.stat(probe)
            except OSError as exc:
                return (f"{shown}: {probe} is a symlink that does not resolve ({exc.strerror or exc}); "
                        f"expected a directory or a path that can be created")
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{shown}: {probe} is not a directory"
    try:  # a real probe: os.access is wrong on read-only mounts and some network filesystems
        fd, tmp = tempfile.mkstemp(prefix=".npu_flashrl_probe.", dir=probe)
    except OSError as exc:
        return f"{shown}: cannot write in {probe}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(tmp)
    return None


@contextlib.contextmanager
def locked_file(path: Union[str, os.PathLike]) -> Iterator[None]:
    """Exclusive fcntl lock on the existing file `path` for a read-modify-write that ends in
    atomic_write (concurrent `setup -a` must not lose entries) or in its removal (`cleanup -p`).
    The lock sits on the inode that atomic_write replaces, so once it is held, check that `path`
    still names that inode; else retry on the new file. FileNotFoundError when `path` was removed
    meanwhile."""
    import fcntl

    path = os.fspath(path)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # no effect on a file; a FIFO does not block
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # FileNotFoundError here: the holder removed the file (`cleanup -p` under this lock)
            now, held = os.stat(path), os.fstat(fd)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def atomic_write(path: Union[str, os.PathLike], write: Callable[[Any], None], binary: bool = False) -> None:
    """Write `path` atomically: `write(fileobj)` into a temp file in the same dir, fsync, os.replace.

    On any failure the temp file is removed and an existing `path` is left untouched. A symlink
    `path` is written through (its target is replaced; the link stays).
    """
    path = write_target(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            mode = os.stat(path).st_mode & 0o7777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def dump_config(cfg: FlashRLConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), default_flow_style=False, sort_keys=False)


def write_config(cfg: FlashRLConfig, path: Union[str, os.PathLike]) -> str:
    """Write `cfg` in FlashRL's schema to `path` atomically; returns the path."""
    text = dump_config(cfg)  # serialize first: a non-serializable value never touches the file
    parse_config(yaml.safe_load(text), os.fspath(path))  # what we write must load back
    atomic_write(path, lambda f: f.write(text))
    cfg.path = os.fspath(path)
    return cfg.path
