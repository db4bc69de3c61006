"""Names shared by the Megatron adapter's modules, and the post-import hook they use to patch verl's
Megatron worker module without importing it (importing it imports Megatron)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from npu_flashrl._logging import get_logger

logger = get_logger("adapters.megatron")

VERL_PIN = "51d2104ecb61563c41123a8f0bce2f06b18387dc"
ADAPTOR = "mindspeed.megatron_adaptor"
# read as _common.WORKER_MODULE at call time: tests point it at a stand-in module
WORKER_MODULE = "verl.workers.megatron_workers"
WORKER_CLASSES = ("ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker")

PATCH_GUARD = "megatron_mindspeed_guard"
PATCH_STREAM = "megatron_weight_stream"
PATCH_LMHEAD = "megatron_lmhead_fp32"
PATCHES = (PATCH_GUARD, PATCH_STREAM)

WRAPPED = "__npu_flashrl_megatron__"


def remove_finder(which) -> None:
    for f in list(sys.meta_path):
        if (isinstance(which, type) and isinstance(f, which)) or f is which:
            sys.meta_path.remove(f)


class _PostImport(importlib.abc.MetaPathFinder):
    """Run ``callback(module)`` right after ``name`` is imported (wraps the real loader)."""

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
                remove_finder(me)
                callback(module)

        spec.loader = _Loader()
        return spec


def when_imported(name: str, callback) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    mod = sys.modules.get(name)
    if mod is not None:
        callback(mod)
        return
    if not any(isinstance(f, _PostImport) and f.name == name and f.callback is callback for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(name, callback))
