"""Patch registry: every change npu_flashrl makes to upstream code is declared here once.

A patch has a name, the dotted target it replaces, the upstream versions it supports (for
line-specific patches: the stack lines it belongs to, `lines`), why it exists and an `apply`
function, and the modules whose import applies it (`when`: by default the target's module).
A name is declared once: a second, different declaration is an error
(`DuplicatePatch`), never silently shadowed. The installed line's vllm-ascend patches are objects
the line returns (`npu_flashrl.lines`), declared with `declare`; other modules use `register`. `apply_patch` is idempotent (a second call is a no-op), logs exactly one DEBUG
line `npu_flashrl: patched <name> -> <target>` when it applies, and a WARNING with the reason when
it cannot. `npu-flashrl verify` lists `status()`.

Activation arms patches (`arm_patches`) instead of importing every target: a patch whose modules
are imported is applied at once; the others are pending until the import of their last module
completes, and are applied right then, inside that import, before the importer reads anything
from the module. A patch applied from an import hook imports nothing itself: every import it
tries of a module that is not imported yet is refused (`ImportError`), which leaves nothing
half-imported (the importing module may itself be half-initialised), and the patch waits for
that module too.

Nothing a patch does from an import hook fails the importer's import: a patch (or a
`when_imported` callback it left) that raises there is recorded as not applied, with the
exception as its reason and a WARNING, and the import goes on. A patch declared `required` (an
INT8 rollout depends on it: without it the job would run bf16 or unchecked) that is not applied
makes `refuse_if_required_failed` raise `RequiredPatchError` naming it and its reason; the engine
build and the INT8 loader's attachment ask it, so such a job refuses instead of running bf16.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from npu_flashrl._logging import get_logger
from npu_flashrl.errors import NpuFlashrlError, UnquantizedRolloutError

logger = get_logger(__name__)


class PatchNotApplicable(NpuFlashrlError, RuntimeError):
    """Raised by a patch's apply function when the target is absent or of an unsupported version."""


class DuplicatePatch(NpuFlashrlError, ValueError):
    """Two different declarations of one patch name."""


class RequiredPatchError(UnquantizedRolloutError):
    """A patch the INT8 rollout depends on (`Patch.required`) could not be applied in this process."""


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
    # the modules whose import applies it when armed (None: the target's module; (): at once)
    when: Optional[Tuple[str, ...]] = None
    pending: Tuple[str, ...] = ()  # armed, waiting for these modules' imports
    refused: Tuple[str, ...] = ()  # imports refused while it was applied from an import hook
    required: bool = False  # an INT8 rollout depends on it: not applied, the job refuses

    def triggers(self) -> Tuple[str, ...]:
        if self.when is not None:
            return tuple(self.when)
        return (self.target.partition(":")[0].split(" ")[0],)

    def as_dict(self) -> dict:
        return {"name": self.name, "target": self.target, "versions": self.versions,
                "applied": self.applied, "error": self.error, "doc": self.doc,
                "lines": list(self.lines), "pending": list(self.pending), "refused": list(self.refused),
                "required": self.required}

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
             lines: Iterable[str] = (), why: str = "", when: Optional[Iterable[str]] = None,
             required: bool = False):
    """Decorator declaring a patch (`declare`: a duplicate name is an error). `why` is the same
    as `doc`; `lines`: the stack lines it belongs to (default: any); `when`: the modules whose
    import applies it once armed (default: the target's module; (): applied when armed);
    `required`: an INT8 rollout depends on it (`refuse_if_required_failed`)."""
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        declare([Patch(name, target, versions, fn, why or doc or (fn.__doc__ or "").strip(),
                       lines=tuple(lines), when=None if when is None else tuple(when),
                       required=required)])
        return fn
    return deco


def get(name: str) -> Patch:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown patch {name!r}; known: {sorted(_REGISTRY)}") from None


def apply_patch(name: str) -> bool:
    """Apply one patch once, now (importing its target). Returns True when it is (now or
    already) applied."""
    patch = get(name)
    if patch.applied:
        return True
    try:
        with _applying(patch):
            patch.apply_fn()
    except PatchNotApplicable as exc:
        return _not_applied(patch, str(exc))
    return _applied(patch)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# the patch whose apply function runs on this thread: a `when_imported` callback it leaves is its
_CURRENT = threading.local()


@contextlib.contextmanager
def _applying(patch: "Patch"):
    outer = getattr(_CURRENT, "patch", None)
    _CURRENT.patch = patch
    try:
        yield
    finally:
        _CURRENT.patch = outer


def required_failures() -> Dict[str, str]:
    """{name: reason} of the required patches (`Patch.required`) that could not be applied in
    this process (a pending one is not a failure yet)."""
    return {p.name: p.error for p in _REGISTRY.values()
            if p.required and not p.applied and p.error}


def refuse_if_required_failed(what: str) -> None:
    """Raise RequiredPatchError when a patch the INT8 rollout depends on could not be applied
    here: `what` (e.g. "the INT8 engine build") would otherwise run bf16 or unchecked."""
    failed = required_failures()
    if failed:
        listed = "; ".join(f"{name} ({_REGISTRY[name].target}): {why}" for name, why in failed.items())
        raise RequiredPatchError(
            f"npu_flashrl: {what} refused: the FlashRL config asks for a quantized rollout but "
            f"patch(es) it depends on could not be applied in this process: {listed}. Without "
            "them the rollout would run unquantized or unchecked. Fix the cause (`npu-flashrl "
            "verify` lists every patch and its reason; install the pinned versions, "
            "npu_flashrl/pins.yaml) or unset FLASHRL_CONFIG")


def _applied(patch: Patch) -> bool:
    patch.applied, patch.error, patch.pending = True, None, ()
    logger.debug("npu_flashrl: patched %s -> %s", patch.name, patch.target)
    return True


def _not_applied(patch: Patch, why: str) -> bool:
    patch.applied, patch.error, patch.pending = False, why, ()
    logger.warning("npu_flashrl: cannot patch %s -> %s%s: %s", patch.name, patch.target,
                   " (required by the INT8 rollout: it will refuse to start)" if patch.required else "",
                   why)
    return False


def apply_patches(names: List[str]) -> Dict[str, bool]:
    result = {n: apply_patch(n) for n in names}
    _log_result(result)
    return result


class Pending(str):
    """What `arm_patch` answers for a patch that waits for an import: true (armed: it applies
    when the modules are imported), and says which modules. A str, so a report that records
    activation's answers (the rehearsal's report.json) writes it as its text."""

    modules: Tuple[str, ...]

    def __new__(cls, modules: Iterable[str]):
        modules = tuple(modules)
        self = super().__new__(cls, f"pending: applied when {' and '.join(modules)} is imported")
        self.modules = modules
        return self


def loaded(module: str) -> bool:
    """`module` is imported and its import has completed (not half-initialised)."""
    mod = sys.modules.get(module)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def arm_patch(name: str) -> Union[bool, Pending]:
    """Apply a patch now if the modules it waits for (`Patch.triggers`) are imported, else right
    after the import of the last of them: True (applied), False (cannot be, WARNING logged) or a
    `Pending` (true) naming the modules it waits for."""
    patch = get(name)
    if patch.applied:
        return True
    waits = [m for m in patch.triggers() if not loaded(m)]
    if not waits:
        return apply_patch(name)
    _wait(patch, waits)
    return Pending(waits)


def arm_patches(names: List[str]) -> Dict[str, Union[bool, Pending]]:
    result = {n: arm_patch(n) for n in names}
    _log_result(result)
    return result


def _log_result(result: Dict[str, Union[bool, Pending]]) -> None:
    ok = [n for n, v in result.items() if v is True]
    wait = [f"{n} ({v.modules[0]})" for n, v in result.items() if isinstance(v, Pending)]
    bad = [n for n, v in result.items() if not v]
    logger.info("npu_flashrl: %d/%d patches applied%s%s", len(ok), len(result),
                f", pending until their module is imported: {', '.join(wait)}" if wait else "",
                f" (not applied: {', '.join(bad)})" if bad else "")


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


# ------------------------------------------------------------------ post-import hooks
# module name -> (the patch that left it or None, callback) to run right after its import
# (`when_imported`)
_CALLBACKS: Dict[str, List[Tuple[Optional[Patch], Callable[[object], None]]]] = {}
_LOCK = threading.RLock()


def _waiting() -> List[Patch]:
    return [p for p in _REGISTRY.values() if p.pending and not p.applied]


def _wanted(fullname: str) -> bool:
    """Whether the import of `fullname` must be followed by a look at what waits: a callback or
    a pending patch waits for it, or a pending patch waits for a module that was half-initialised
    when it was armed (its end has no hook of its own: the next import completing looks)."""
    if fullname in _CALLBACKS:
        return True
    for patch in _waiting():
        if fullname in patch.pending or any(m in sys.modules for m in patch.pending):
            return True
    return False


class _Loader(importlib.abc.Loader):
    """The real loader, then what waits for the module; the module keeps the real loader."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            try:
                module.__loader__ = self._loader
            except (AttributeError, TypeError):  # a module class refusing new attributes (torch's
                pass                             # config modules): it keeps this delegating loader
        _imported(module.__name__, module)

    def __getattr__(self, name):  # get_source, get_data, is_package, resource readers ...
        return getattr(self._loader, name)


class _PostImport(importlib.abc.MetaPathFinder):
    """One finder for every post-import hook: wraps the real loader of a module something waits
    for (it runs the callbacks and applies the pending patches right after the module's code
    ran, before the importer reads from it)."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy or not _wanted(fullname):
            return None
        busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _PostImport()


def _install_finder() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


# callbacks that raised with no patch to charge it to: (module, callback, reason); `verify` lists them
CALLBACK_ERRORS: List[Tuple[str, str, str]] = []


def _imported(name: str, module) -> None:
    with _LOCK:
        callbacks = _CALLBACKS.pop(name, [])
    for owner, callback in callbacks:
        _run_callback(name, module, owner, callback)
    _settle(done=name)


def _run_callback(name: str, module, owner: Optional[Patch], callback) -> None:
    """One post-import callback, inside the import of `name`: its failure never fails the
    importer's import; it is charged to the patch that left it (not applied, with the reason)."""
    try:
        if owner is None:
            callback(module)
        else:
            with _applying(owner):
                callback(module)
    except Exception as exc:  # noqa: BLE001 - the importer's import goes on; the failure is recorded
        why = f"after the import of {name}: {_reason(exc)}"
        if owner is not None:
            _not_applied(owner, why)
            return
        label = getattr(callback, "__qualname__", repr(callback))
        CALLBACK_ERRORS.append((name, label, why))
        logger.warning("npu_flashrl: post-import callback %s failed %s", label, why)


class _RefuseImports(importlib.abc.MetaPathFinder):
    """On this thread, while a pending patch is applied from an import hook: any import of a module
    that is not imported yet is refused (and remembered), never started."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.refused: List[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if threading.get_ident() != self.thread:
            return None
        self.refused.append(fullname)
        raise ImportError(f"npu_flashrl: a patch applied from an import hook imports nothing "
                          f"({fullname} is not imported yet)", name=fullname)


def _wait(patch: Patch, modules: Iterable[str]) -> None:
    with _LOCK:
        patch.pending = tuple(dict.fromkeys(list(patch.pending) + list(modules)))
    _install_finder()
    logger.debug("npu_flashrl: %s -> %s pending: applied when %s is imported", patch.name,
                 patch.target, " and ".join(patch.pending))


def _settle(done: Optional[str] = None) -> None:
    """Apply every pending patch whose modules are all imported now (`done`: the module whose
    code just ran; its import is not marked complete yet)."""
    for patch in _waiting():
        waits = tuple(m for m in patch.pending if m != done and not loaded(m))
        if waits:
            patch.pending = waits
            continue
        with _LOCK:
            if patch.applied or not patch.pending:
                continue
            patch.pending = ()
        _apply_in_hook(patch)


def _apply_in_hook(patch: Patch) -> None:
    refuse = _RefuseImports()
    sys.meta_path.insert(0, refuse)
    try:
        with _applying(patch):
            patch.apply_fn()
    except Exception as exc:  # noqa: BLE001 - a refused import shows as whatever the patch raised
        if refuse.refused:
            _refused(patch, refuse.refused)
            return
        # inside the importer's import: whatever the patch raised is its reason, never the
        # importer's failure
        _not_applied(patch, str(exc) if isinstance(exc, PatchNotApplicable) else _reason(exc))
        return
    finally:
        sys.meta_path.remove(refuse)
    if refuse.refused:  # the patch caught the refusal itself: wait for the module and try again
        _refused(patch, refuse.refused)
        return
    _applied(patch)


def _refused(patch: Patch, modules: List[str]) -> None:
    patch.refused = tuple(dict.fromkeys(patch.refused + tuple(modules)))
    logger.debug("npu_flashrl: %s needs %s, not imported yet: it waits for it too", patch.name,
                 ", ".join(modules))
    _wait(patch, modules)


def when_imported(name: str, callback: Callable[[object], None]) -> None:
    """``callback(module)`` now if module ``name`` is imported, else right after its import: patch a
    module that only some processes import (e.g. a verl worker module) without importing it here."""
    mod = sys.modules.get(name)
    if mod is not None:
        callback(mod)
        return
    owner = getattr(_CURRENT, "patch", None)  # the patch applying now: a failure is charged to it
    with _LOCK:
        callbacks = _CALLBACKS.setdefault(name, [])
        if all(cb is not callback for _, cb in callbacks):
            callbacks.append((owner, callback))
    _install_finder()
