"""MindSpeed before Megatron: the import guard (every process) and the strict check (Megatron workers).

MindSpeed adapts Megatron to Ascend by replacing attributes of Megatron modules when
``mindspeed.megatron_adaptor`` is imported; names Megatron modules already bound with ``from x import
y`` before that keep the CUDA versions. The pinned sync-mode verl tries MindSpeed first itself, in two
places:

* ``verl/workers/engine/__init__.py`` (``try: from .mindspeed import ...`` whose module does ``from
  mindspeed.megatron_adaptor import repatch``, then ``from .megatron import ...``): this is verl's FIRST
  MindSpeed/Megatron import in EVERY worker process, FSDP ones included, reached through
  ``verl.utils.checkpoint`` (``checkpoint_handler.py``) from both ``fsdp_workers`` and ``megatron_workers``;
* the top of ``verl/workers/megatron_workers.py`` (``try: from mindspeed.megatron_adaptor import repatch
  / except ImportError: repatch = None``, then ``from megatron.core import parallel_state``).

Both swallow ``ImportError``, so a missing or broken MindSpeed goes unnoticed until Megatron fails on
the NPU. Two tools, with different strictness:

* :func:`install_import_guard` (every process; FSDP jobs too, since verl imports Megatron there): the
  first ``import megatron`` imports ``mindspeed.megatron_adaptor`` first when MindSpeed is installed.
  It never raises because MindSpeed is absent or broken (a broken one is reported by a WARNING and
  remembered): an FSDP job needs neither.
* :func:`ensure_mindspeed_before_megatron` (called where a Megatron model is really built: verl's
  Megatron worker ``__init__``, see ``workers.py``): raises :class:`MindSpeedMissingError` on NPU
  without MindSpeed, re-raises a remembered MindSpeed import error, and raises
  :class:`MindSpeedImportOrderError` when Megatron was imported before the adaptor (detected from the
  order of ``sys.modules``: a module's key is inserted when its import *starts*).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Dict, Optional, Sequence, Tuple

from npu_flashrl.adapters.megatron._common import ADAPTOR, logger, remove_finder

# The one hook the recipes (tests/verl_examples/common.sh) set; '++' adds it or overrides the recipe's
# '+' without Hydra's "Could not append" error.
RAY_HOOK = "npu_flashrl.activation.worker_process_setup"
RAY_HOOK_OVERRIDE = f"++ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={RAY_HOOK}"


class MindSpeedError(RuntimeError):
    """MindSpeed / Megatron set-up problem on the trainer side."""


class MindSpeedMissingError(MindSpeedError):
    pass


class MindSpeedImportOrderError(MindSpeedError):
    pass


# what the guard saw: the adaptor's import error (re-raised by the strict check)
_state: Dict[str, Optional[BaseException]] = {"adaptor_error": None}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _npu_device(device: Optional[str]) -> bool:
    """`device` as verl's ``trainer.device`` ('npu', 'cuda', ...); None: torch_npu really importable."""
    if device is not None:
        return str(device).lower().startswith("npu")
    loaded = sys.modules.get("torch_npu")
    if loaded is not None:  # npu_flashrl's CPU emulation of torch_npu is no NPU
        return not getattr(loaded, "__npu_flashrl_emulated__", False)
    if not _importable("torch_npu"):
        return False
    try:
        mod = importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - a torch_npu that cannot load is no NPU
        return False
    return not getattr(mod, "__npu_flashrl_emulated__", False)


def _mindspeed_pin() -> Tuple[str, str]:
    try:
        from npu_flashrl.pins import load_pins

        ms = load_pins()["packages"]["mindspeed"]
        return str(ms.get("repo", "https://gitee.com/ascend/MindSpeed.git")), str(ms["commit"])
    except Exception as exc:  # noqa: BLE001 - the message must still be produced
        return "https://gitee.com/ascend/MindSpeed.git", f"<pinned commit: pins.yaml unreadable: {exc}>"


def missing_message() -> str:
    repo, commit = _mindspeed_pin()
    return ("verl's Megatron backend (actor_rollout_ref.actor.strategy=megatron) on Ascend NPU needs MindSpeed, "
            "and it is not installed in this Python environment. Install it from source at the pinned commit: "
            f"git clone {repo} MindSpeed && cd MindSpeed && git checkout {commit} && pip install -e . "
            "(scripts/install_pinned.sh does this), or use the FSDP backend (strategy=fsdp), which does not "
            "need MindSpeed.")


def _first_index(keys: Sequence[str], pred) -> Optional[int]:
    for i, k in enumerate(keys):
        if pred(k):
            return i
    return None


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def import_order() -> Dict[str, Optional[int]]:
    """Positions in ``sys.modules`` (insertion = import start) of the first megatron module, of the
    ``mindspeed`` package and of ``mindspeed.megatron_adaptor`` (None when not imported)."""
    keys = list(sys.modules.keys())
    return {"megatron": _first_index(keys, _is_megatron),
            "mindspeed": _first_index(keys, lambda k: k == "mindspeed"),
            "adaptor": _first_index(keys, lambda k: k == ADAPTOR)}


def _order_error(what: str) -> MindSpeedImportOrderError:
    return MindSpeedImportOrderError(
        f"{what}. MindSpeed adapts Megatron to Ascend by patching Megatron modules when "
        f"`import {ADAPTOR}` runs; modules imported before that keep the CUDA code. Fix: import "
        f"{ADAPTOR} before anything imports megatron: first line of the entry point; for verl's Ray "
        f"workers, Ray's worker_process_setup_hook={RAY_HOOK} (the recipes in tests/verl_examples set it; "
        f"for your own launch command add {RAY_HOOK_OVERRIDE}); and do not import megatron/verl.models.mcore "
        "from reward or plugin modules loaded earlier.")


_ensure_busy = False


def ensure_mindspeed_before_megatron(device: Optional[str] = None) -> Optional[str]:
    """Make sure MindSpeed's Megatron adaptor is imported before Megatron in this process (strict).

    * MindSpeed installed: imports ``mindspeed.megatron_adaptor`` if Megatron is not imported yet
      (returns ``"imported"``) or checks it was imported first (``"already"``); raises
      :class:`MindSpeedImportOrderError` when a megatron module was imported before it. An import
      error inside MindSpeed propagates (verl's ``except ImportError`` would hide it), also one the
      import guard met earlier in this process.
    * MindSpeed absent on NPU (``device`` 'npu', or ``device=None`` and torch_npu importable): raises
      :class:`MindSpeedMissingError` naming the pinned commit. Elsewhere returns None.
    """
    global _ensure_busy
    err = _state["adaptor_error"]
    if err is not None and ADAPTOR not in sys.modules:
        raise err
    order = import_order()
    if not _importable("mindspeed") and order["mindspeed"] is None:
        if _npu_device(device):
            raise MindSpeedMissingError(missing_message())
        return None
    if order["adaptor"] is not None:
        first_ms = min(i for i in (order["mindspeed"], order["adaptor"]) if i is not None)
        if order["megatron"] is not None and order["megatron"] < first_ms:
            raise _order_error(f"megatron was imported before {ADAPTOR} in this process")
        return "already"
    if order["megatron"] is not None:
        raise _order_error(f"megatron ({next(k for k in sys.modules if _is_megatron(k))}) is already imported "
                           f"and {ADAPTOR} is not")
    if _ensure_busy:
        return "importing"
    _ensure_busy = True
    try:
        importlib.import_module(ADAPTOR)
    finally:
        _ensure_busy = False
    logger.debug("npu_flashrl: imported %s before megatron", ADAPTOR)
    return "imported"


class _AlreadyLoaded(importlib.abc.Loader):
    """Hands the import system the ``megatron`` module that exists already.

    Once a finder is asked for ``megatron`` the import system is committed to loading it: if the
    finder imported the adaptor (which imports megatron itself) and returned None, the next finder's
    spec would be replaced by the loaded module's own ``__spec__`` (importlib's ``_find_spec`` does
    that when the name appeared in ``sys.modules`` meanwhile), whose namespace loader builds a second,
    empty ``megatron`` package over the first: ``megatron.core`` would no longer be an attribute of
    ``megatron``. So the module's ``__spec__`` points at this loader until the import system has
    "loaded" it (the same object), then the real spec is put back."""

    def __init__(self, module):
        self.module = module
        self.spec = getattr(module, "__spec__", None)

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        if self.spec is not None:  # the import system set our spec on it; keep the real one
            module.__spec__ = self.spec


def guard_import_adaptor() -> None:
    """What the guard does on the first ``import megatron``: import the adaptor first when MindSpeed
    is installed; never raise (an FSDP job imports Megatron through verl without needing it)."""
    if ADAPTOR in sys.modules or _ensure_busy:
        return  # verl's own `from mindspeed.megatron_adaptor import ...` is running (or ran)
    if not _importable("mindspeed"):
        logger.debug("npu_flashrl: MindSpeed not installed; megatron imported without it")
        return
    try:
        ensure_mindspeed_before_megatron()
    except Exception as exc:  # noqa: BLE001 - reported here, raised where a Megatron model is built
        _state["adaptor_error"] = exc
        logger.warning("npu_flashrl: %s failed to import (%s: %s); megatron is imported without MindSpeed. "
                       "FSDP jobs are unaffected; a Megatron worker will refuse to start with this error.",
                       ADAPTOR, type(exc).__name__, exc)


class _MegatronImportGuard(importlib.abc.MetaPathFinder):
    """One-shot: on the first ``import megatron`` import the MindSpeed adaptor first (if installed)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "megatron" or _ensure_busy:
            return None
        remove_finder(_MegatronImportGuard)
        guard_import_adaptor()
        loaded = sys.modules.get("megatron")
        if loaded is not None:  # the adaptor imported megatron: keep that module
            spec = importlib.util.spec_from_loader("megatron", _AlreadyLoaded(loaded), is_package=True)
            loaded.__spec__ = spec
            return spec
        return None


def install_import_guard(device: Optional[str] = None) -> bool:
    """Install the one-shot ``import megatron`` guard (idempotent). Returns False when Megatron is
    already imported (then only :func:`ensure_mindspeed_before_megatron` can tell, by raising).
    ``device`` is accepted for compatibility and unused: the guard does the same on every device."""
    if import_order()["megatron"] is not None:
        return False
    if not any(isinstance(f, _MegatronImportGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronImportGuard())
    return True
