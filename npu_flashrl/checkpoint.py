"""Read-only access to a HF safetensors checkpoint dir: the shards' headers (names, dtypes, shapes)
without loading tensor data until a tensor is asked for; every error names the file and tensor."""
from __future__ import annotations

import contextlib
import errno
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from npu_flashrl._files import special_file_problem
from npu_flashrl.errors import ProfileError


class SafetensorsCheckpoint:
    """Lazy, name-indexed access to a HF safetensors checkpoint dir (headers only until asked)."""

    def __init__(self, model_dir: str):
        self.dir = os.fspath(model_dir)
        if not os.path.isdir(self.dir):
            raise ProfileError(f"{self.dir}: not a directory (expected a HF checkpoint dir with *.safetensors)")
        self.files: Dict[str, str] = self._index()
        self._stack = contextlib.ExitStack()
        self._handles: Dict[str, Any] = {}

    def _index(self) -> Dict[str, str]:
        index_path = os.path.join(self.dir, "model.safetensors.index.json")
        if os.path.exists(index_path):
            special = special_file_problem(index_path)
            if special:
                raise ProfileError(f"{index_path}: {special} (the safetensors index)")
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError("weight_map must map tensor names to shard file names")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ProfileError(f"{index_path}: unreadable safetensors index ({_first_line(exc)})") from exc
            for name, shard in weight_map.items():
                problem = shard_name_problem(shard)
                if problem:
                    raise ProfileError(f"{index_path}: weight_map[{name!r}] = {shard!r}: {problem}")
            out = {k: os.path.join(self.dir, v) for k, v in weight_map.items()}
            missing = sorted({p for p in out.values() if not os.path.lexists(p)})
            if missing:
                raise ProfileError(f"{index_path}: lists missing shard(s) {missing[:3]}")
            for path in sorted(set(out.values())):  # headers only: a bad shard named up front
                have = set(read_header_names(path))
                absent = sorted(k for k, p in out.items() if p == path and k not in have)
                if absent:
                    raise ProfileError(f"{index_path}: lists {absent[0]!r} in {path}, whose header has no such "
                                       f"tensor ({len(absent)} such name(s)): the index and the shard do not match")
            return out
        try:
            files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
        except OSError as exc:
            raise ProfileError(f"{self.dir}: cannot list the checkpoint dir: {exc.strerror or exc}") from exc
        if not files:
            raise ProfileError(f"{self.dir}: no *.safetensors files (a safetensors HF checkpoint is needed)")
        out = {}
        for fname in files:
            path = os.path.join(self.dir, fname)
            for k in read_header_names(path):
                out[k] = path
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> List[str]:
        return list(self.files)

    def _handle(self, path: str):
        from safetensors import safe_open

        if path not in self._handles:
            _check_readable(path)
            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as exc:  # safetensors raises its own error types; name the shard
                raise ProfileError(f"{path}: unreadable safetensors file ({_first_line(exc)}); "
                                   f"truncated or corrupt shard?") from exc
        return self._handles[path]

    def _read(self, name: str, what):
        path = self.files[name]
        handle = self._handle(path)
        try:
            return what(handle)
        except Exception as exc:  # a shard truncated after its header, a bad dtype, ...
            raise ProfileError(f"{path}: cannot read tensor {name!r} ({_first_line(exc)}); "
                               f"truncated or corrupt shard?") from exc

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ProfileError(f"{self.dir}: tensor {name!r} not found")
        return self._read(name, lambda h: h.get_tensor(name))

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._read(name, lambda h: h.get_slice(name).get_shape()))

    def dtype(self, name: str) -> str:
        """safetensors' dtype string from the header ("I8", "BF16", ...), no data read."""
        return str(self._handle(self.files[name]).get_slice(name).get_dtype())

    def dtype_str(self, name: str) -> str:
        return self._read(name, lambda h: h.get_slice(name).get_dtype())

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def shard_name_problem(shard: str) -> Optional[str]:
    """Why a weight_map entry is not a file of the checkpoint dir itself (None: it is): an absolute
    path or a `..` component would read another model's weights. Lexical, not resolved: shards that
    are symlinks into a cache (the Hugging Face hub layout) stay valid."""
    if not shard or os.path.isabs(shard) or shard.startswith("~"):
        return "expected a shard file name inside the checkpoint dir, not an absolute or empty path"
    parts = shard.replace("\\", "/").split("/")
    if ".." in parts:
        return "expected a shard file name inside the checkpoint dir; '..' leaves it"
    return None


def _check_readable(path: str) -> None:
    """An OSError opening `path` as itself (permissions, a dangling symlink), not as 'corrupt'; a
    FIFO or device named before any open (it would block)."""
    special = special_file_problem(path)
    if special:
        raise ProfileError(f"{path}: {special} (a safetensors shard of the checkpoint)")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        hint = {errno.EACCES: "check the file's permissions", errno.EPERM: "check the file's permissions",
                errno.ENOENT: "a dangling symlink?", errno.EISDIR: "expected a file"}.get(exc.errno, "")
        raise ProfileError(f"{path}: cannot open the shard: {exc.strerror or exc}"
                           + (f" ({hint})" if hint else "")) from exc


def read_header_names(path: str) -> List[str]:
    """The tensor names of one safetensors file, from its header only. safetensors' own header
    check refuses a truncated file, a header length past the file (e.g. 2^40 bytes) and data
    offsets outside the file or not covering it; a file with no tensors is refused here."""
    from safetensors import safe_open

    _check_readable(path)
    try:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
    except Exception as exc:  # safetensors raises its own error types
        raise ProfileError(f"{path}: unreadable safetensors file ({_first_line(exc)}); "
                           f"truncated or corrupt shard?") from exc
    if not names:
        raise ProfileError(f"{path}: a safetensors file with no tensors (expected weights of the checkpoint; "
                           f"an incomplete download or a placeholder?)")
    return names


def checkpoint_problem(model_dir: str) -> Optional[str]:
    """Why `model_dir` cannot be loaded as a safetensors checkpoint (None: every shard's header and
    data offsets are sound). Headers only: no tensor data is read, whatever the checkpoint's size."""
    try:
        SafetensorsCheckpoint(model_dir).close()
    except ProfileError as exc:
        return str(exc)
    return None


# config.json keys that one model's checkpoints (bf16, W8A8) share; a hybrid config's entries are
# DP groups of one rollout model, so entries that differ here describe different models.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "vocab_size")


def architecture(model_dir: str) -> Optional[Dict[str, Any]]:
    """ARCHITECTURE_KEYS of `model_dir`/config.json (text_config for multimodal wrappers); None when
    there is no readable config.json (nothing to compare)."""
    path = os.path.join(model_dir, "config.json")
    if special_file_problem(path):
        return None  # not opened (a FIFO would block): nothing to compare
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("text_config"), dict) and "hidden_size" not in data:
        data = data["text_config"]
    return {k: data[k] for k in ARCHITECTURE_KEYS if k in data}


def architecture_mismatch(models: List[Tuple[str, str]]) -> Optional[str]:
    """Why the (label, model dir) pairs are not one model (None: they agree wherever both say)."""
    seen: List[Tuple[str, str, Dict[str, Any]]] = []
    for label, model_dir in models:
        arch = architecture(model_dir)
        if arch is None:
            continue
        for other_label, other_dir, other in seen:
            for key in ARCHITECTURE_KEYS:
                if key in arch and key in other and arch[key] != other[key]:
                    return (f"{other_label} ({other_dir}) and {label} ({model_dir}) are different models: "
                            f"{key} {other[key]!r} vs {arch[key]!r} in their config.json (the entries of one "
                            f"config are DP groups of one rollout model)")
        seen.append((label, model_dir, arch))
    return None
