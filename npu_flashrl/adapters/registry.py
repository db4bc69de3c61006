"""Which adapters apply in this process, each declaring when it does (verl's registry style).

`activate` asks every registered adapter, in order, whether it applies to the `Process` found
here (which upstream packages are importable, how the installed verl drives its rollout, whether
the fp32 lm head is asked for) and, if so, which of its patches to apply. Conditions are checked
before the adapter module is imported: some adapter imports have effects (the server-mode verl
adapter registers verl's server engines with the engine patch), which only a process they apply
to should see.

Adding an adapter: a module under `npu_flashrl.adapters` declaring its patches, and one
`register_adapter(...)` entry below.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from typing import Callable, Dict, List, Tuple

from npu_flashrl.errors import NpuFlashrlError


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def installed(dist: str) -> bool:
    """By distribution metadata: asking the import system about `megatron` would trigger the
    MindSpeed import-order guard."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


@dataclasses.dataclass(frozen=True)
class Process:
    """What this process has, probed once per `activate`."""
    vllm_ascend: bool
    vllm: bool
    flash_rl: bool
    verl: bool
    verl_server_mode: bool   # verl drives its rollout as a vLLM server fed by bucketed syncs
    transformers: bool
    megatron: bool           # megatron-core installed or already imported
    lmhead_fp32: bool        # FLASHRL_LMHEAD_FP32 asks for the fp32 lm head

    @classmethod
    def probe(cls) -> "Process":
        from npu_flashrl import lines
        from npu_flashrl.config import lmhead_fp32_requested

        verl = importable("verl")
        return cls(vllm_ascend=importable("vllm_ascend"), vllm=importable("vllm"),
                   flash_rl=importable("flash_rl"), verl=verl,
                   verl_server_mode=verl and lines.verl_server_mode(),
                   transformers=importable("transformers"),
                   megatron=installed("megatron-core") or "megatron" in sys.modules,
                   lmhead_fp32=lmhead_fp32_requested())


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str                                       # module under npu_flashrl.adapters
    applies: Callable[[Process], bool]              # checked before the module is imported
    patches: Callable[[object, Process], List[str]]  # (the imported module, process) -> names


_REGISTRY: Dict[str, AdapterSpec] = {}


class DuplicateAdapter(NpuFlashrlError, ValueError):
    pass


def register_adapter(name: str, *, applies: Callable[[Process], bool],
                     patches: Callable[[object, Process], List[str]]) -> AdapterSpec:
    if name in _REGISTRY:
        raise DuplicateAdapter(f"adapter {name!r} is registered twice")
    spec = AdapterSpec(name, applies, patches)
    _REGISTRY[name] = spec
    return spec


def registered() -> Tuple[AdapterSpec, ...]:
    return tuple(_REGISTRY.values())


def patch_names(proc: Process) -> List[str]:
    """The patches every applying adapter asks for, in registration order."""
    names: List[str] = []
    for spec in _REGISTRY.values():
        if spec.applies(proc):
            names += spec.patches(importlib.import_module(f"npu_flashrl.adapters.{spec.name}"), proc)
    return names


# --- the adapters, in the order their patches apply --------------------------------------------
register_adapter("vllm_ascend", applies=lambda p: p.vllm_ascend,  # INT8 layers and their reload
                 patches=lambda m, p: list(m.PATCHES))
register_adapter("vllm_engine", applies=lambda p: p.vllm,  # the engine's INT8 choice
                 patches=lambda m, p: [m.PATCH_NAME])
register_adapter("vllm_lm_head", applies=lambda p: p.vllm and p.lmhead_fp32,  # rollout-side fp32 lm head
                 patches=lambda m, p: list(m.PATCHES))
register_adapter("flashrl", applies=lambda p: p.flash_rl,  # FlashRL yields on Ascend
                 patches=lambda m, p: [m.PATCH_NAME] if m.should_yield() else [])
register_adapter("verl", applies=lambda p: p.verl,  # TIS metrics on both verl lines
                 patches=lambda m, p: [m.PATCH_DRIVER, m.PATCH_ACTOR])
# server-mode verl: the syncs arrive in its vLLM workers (importing the module registers verl's
# server engines with the engine patch)
register_adapter("verl.server_mode", applies=lambda p: p.verl and p.vllm and p.verl_server_mode,
                 patches=lambda m, p: list(m.PATCHES))
register_adapter("verl.checkpoint_engine",  # one-step-off / fully-async
                 applies=lambda p: p.verl and p.vllm and p.verl_server_mode,
                 patches=lambda m, p: list(m.PATCHES))
# sync-mode verl: rollout workers end every sync checked
register_adapter("verl.sync_mode", applies=lambda p: p.verl and p.vllm and not p.verl_server_mode,
                 patches=lambda m, p: [m.PATCH_SYNC_END])
register_adapter("transformers",  # trainer-side fp32 lm head
                 applies=lambda p: p.verl and p.lmhead_fp32 and p.transformers,
                 patches=lambda m, p: [m.PATCH_NAME])
# Megatron / MindSpeed trainer: waits for verl's Megatron worker module (server-mode verl: its
# engine module); cheap when the FSDP backend is used
register_adapter("megatron", applies=lambda p: p.verl and p.megatron,
                 patches=lambda m, p: list(m.ENGINE_PATCHES) if p.verl_server_mode else
                 list(m.PATCHES) + ([m.PATCH_LMHEAD] if p.lmhead_fp32 else []))
