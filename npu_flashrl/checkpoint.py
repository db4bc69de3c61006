"""Read-only access to a HF safetensors checkpoint dir: the shards' headers (names, dtypes, shapes)
without loading tensor data until a tensor is asked for; every error names the file and tensor."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, List, Tuple

import torch

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
        from safetensors import safe_open

        index_path = os.path.join(self.dir, "model.safetensors.index.json")
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError("weight_map must map tensor names to shard file names")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ProfileError(f"{index_path}: unreadable safetensors index ({_first_line(exc)})") from exc
            out = {k: os.path.join(self.dir, v) for k, v in weight_map.items()}
            missing = sorted({p for p in out.values() if not os.path.exists(p)})
            if missing:
                raise ProfileError(f"{index_path}: lists missing shard(s) {missing[:3]}")
            for path in sorted(set(out.values())):  # headers only: a bad shard named up front
                try:
                    with safe_open(path, framework="pt"):
                        pass
                except Exception as exc:
                    raise ProfileError(f"{path}: unreadable safetensors file ({_first_line(exc)}); "
                                       f"truncated or corrupt shard?") from exc
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
            try:
                with safe_open(path, framework="pt") as f:
                    for k in f.keys():
                        out[k] = path
            except Exception as exc:  # safetensors raises its own error types
                raise ProfileError(f"{path}: unreadable safetensors file ({_first_line(exc)}); "
                                   f"truncated or corrupt shard?") from exc
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> List[str]:
        return list(self.files)

    def _handle(self, path: str):
        from safetensors import safe_open

        if path not in self._handles:
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
