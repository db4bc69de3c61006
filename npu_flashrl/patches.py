"""Patch registry: every change npu_flashrl makes to upstream code is declared here once.

A patch has a name, the dotted target it replaces, the upstream versions it supports (for
line-specific patches: the stack lines it belongs to, `lines`), why it exists and an `apply`
function. A name is declared once: a second, different declaration is an error
(`DuplicatePatch`), never silently shadowed. The installed line's vllm-ascend patches are objects
the line returns (`npu_flashrl.lines`), declared with `declare`; other modules use `register`. `apply_patch` is idempotent (a second call is a no-op), logs exactly one DEBUG
line `npu_flashrl: patched <name> -> <target>` when it applies, and a WARNING with the reason when
it cannot. `npu-flashrl verify` lists `status()`.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import sys
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from npu_flashrl._logging import get_logger

logger = get_logger("patches")


class PatchNotApplicable(RuntimeError):
    """Raised by a patch's apply function when the target is absent or of an unsupported version."""


class DuplicatePatch(ValueError):
    """Two different declarations of one patch name."""


@dataclasses.dataclass
class Patch:
    name: str
    target: str
    versions: str
    apply_fn: Callable[[], None]
    doc: str = ""
    applied: bool = False
    error: Optional[str] = None
    lines: Tuple[str, ...] = ()  # the stack lines (vllm-ascend releases) it belongs to; () = any

    def as_dict(self) -> dict:
        return {"name": self.name, "target": self.target, "versions": self.versions,
                "applied": self.applied, "error": self.error, "doc": self.doc,
                "lines": list(self.lines)}

    def _origin(self) -> Tuple[str, str, str, str]:
        fn = self.apply_fn
        return (self.target, self.versions, getattr(fn, "__module__", ""),
                getattr(fn, "__qualname__", ""))


_REGISTRY: Dict[str, Patch] = {}


def declare(patches: Iterable[Patch]) -> None:
    """Add patch objects to the registry. The same declaration again (e.g. its module executed
    twice) keeps the first; another declaration of a taken name raises DuplicatePatch."""
    for patch in patches:
        have = _REGISTRY.get(patch.name)
        if have is None:
            _REGISTRY[patch.name] = patch
        elif have is not patch and have._origin() != patch._origin():
            raise DuplicatePatch(
                f"patch {patch.name!r} is declared twice: {have.target} [{have.versions}] by "
                f"{have._origin()[2]}.{have._origin()[3]}, and {patch.target} [{patch.versions}] "
                f"by {patch._origin()[2]}.{patch._origin()[3]}; a name names one patch")


def register(name: str, target: str, versions: str = "", doc: str = "", *,
             lines: Iterable[str] = (), why: str = ""):
    """Decorator declaring a patch (`declare`: a duplicate name is an error). `why` is the same
    as `doc`; `lines`: the stack lines it belongs to (default: any)."""
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        declare([Patch(name, target, versions, fn, why or doc or (fn.__doc__ or "").strip(),
                       lines=tuple(lines))])
        return fn
    return deco


def get(name: str) -> Patch:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown patch {name!r}; known: {sorted(_REGISTRY)}") from None


def apply_patch(name: str) -> bool:
    """Apply one patch once. Returns True when it is (now or already) applied."""
    patch = get(name)
    if patch.applied:
        return True
    try:
        patch.apply_fn()
    except PatchNotApplicable as exc:
        patch.error = str(exc)
        logger.warning("npu_flashrl: cannot patch %s -> %s: %s", patch.name, patch.target, exc)
        return False
    patch.applied = True
    patch.error = None
    logger.debug("npu_flashrl: patched %s -> %s", patch.name, patch.target)
    return True


def apply_patches(names: List[str]) -> Dict[str, bool]:
    result = {n: apply_patch(n) for n in names}
    ok = [n for n, v in result.items() if v]
    bad = [n for n, v in result.items() if not v]
    logger.info("npu_flashrl: %d/%d patches applied%s", len(ok), len(result),
                f" (not applied: {', '.join(bad)})" if bad else "")
    return result


def status() -> List[dict]:
    return [p.as_dict() for p in _REGISTRY.values()]


def resolve(target: str):
    """Import `pkg.module:Attr.sub` and return (owner, attr_name, current_value)."""
    module_name, _, attr_path = target.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except Exception as exc:  # upstream not installed or failing to import
        raise PatchNotApplicable(f"cannot import {module_name}: {exc}") from exc
    parts = attr_path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise PatchNotApplicable(f"{module_name} has no {attr_path}")
    if not hasattr(owner, parts[-1]):
        raise PatchNotApplicable(f"{module_name} has no {attr_path}")
    return owner, parts[-1], getattr(owner, parts[-1])


ORIGINAL_ATTR = "__npu_flashrl_original__"


def replace(target: str, make_new: Callable[[object], object]) -> None:
    """Replace the object at `target` with `make_new(original)`; never wraps a wrapper twice."""
    owner, attr, current = resolve(target)
    if getattr(current, ORIGINAL_ATTR, None) is not None:
        return
    new = make_new(current)
    try:
        setattr(new, ORIGINAL_ATTR, current)
    except (AttributeError, TypeError):
        pass
    setattr(owner, attr, new)


def original(obj):
    """The upstream object behind one of our replacements (or obj itself)."""
    return getattr(obj, ORIGINAL_ATTR, obj)


class _PostImport(importlib.abc.MetaPathFinder):
    """Run ``callback(module)`` right after ``name`` is imported (wraps the real loader once)."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, callback, me = spec.loader, self.callback, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec_):
                return loader.create_module(spec_)

            def exec_module(self, module):
                loader.exec_module(module)
                if me in sys.meta_path:
                    sys.meta_path.remove(me)
                callback(module)

        spec.loader = _Loader()
        return spec


def when_imported(name: str, callback: Callable[[object], None]) -> None:
    """``callback(module)`` now if module ``name`` is imported, else right after its import: patch a
    module that only some processes import (e.g. a verl worker module) without importing it here."""
    mod = sys.modules.get(name)
    if mod is not None:
        callback(mod)
        return
    if not any(isinstance(f, _PostImport) and f.name == name and f.callback is callback for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(name, callback))
