"""FlashRL (flash-llm-rl 1.0.3, import name `flash_rl`) coexistence: detect it, make it yield on Ascend.

What FlashRL 1.0.3 changes when `import flash_rl` runs with `FLASHRL_CONFIG` set (flash_rl/__init__.py,
flash_rl/vllm_patch.py). Every patch guards itself with a marker attribute `beforeflashrl_*` on the
patched object, holding the original, and skips ("already patched") when the marker exists:

=============================================================  ====================================
patched object                                                 marker attribute
=============================================================  ====================================
vllm.LLM.__init__ (swap model/kwargs from the config, load the  LLM.beforeflashrl__init__
profile, wrap model.load_weights with re-allocate + reload +
process_weights_after_loading + copy-back; and on every LLM
init it patches Sampler.forward, below)
vllm...model_loader.utils.process_weights_after_loading          utils.beforeflashrl_process_weights_after_loading
vllm...model_loader.loader._process_weights_after_loading (old)  loader.beforeflashrl_process_weights_after_loading
vllm...model_loader.base_loader.BaseModelLoader.load_model       BaseModelLoader.beforeflashrl_load_model
vllm...quantization.kv_cache.BaseKVCacheMethod                   BaseKVCacheMethod.beforeflashrl_process_weights_after_loading
  .process_weights_after_loading (sets k/v/q/prob_scale=-1.0)
vllm...quantization.fp8.Fp8LinearMethod.create_weights           Fp8LinearMethod.beforeflashrl_create_weights
  (allocates outside the CuMem "weights" pool; CUDA only)
vllm.v1.sample.sampler.Sampler.forward (fp32 logits; a          Sampler.beforeflashrl_forward
  re-implementation of the sampler of older vLLM)
FLASHRL_TEST_RELOAD: vllm.LLM.__init__ (reload at init)         LLM.beforeflashrl_test__init__
FLASHRL_LMHEAD_FP32=1: VocabParallelEmbedding.__init__           VocabParallelEmbedding.beforeflashrl_VocabParallelEmbedding
  (fp32 params, quant_config dropped, per-instance forward cast)
FLASHRL_LMHEAD_FP32=1: UnquantizedEmbeddingMethod.apply (fp32)   UnquantizedEmbeddingMethod.beforeflashrl_apply
=============================================================  ====================================

Unconditionally, at import, it also configures the ROOT logger (level from FLASHRL_LOGGING_LEVEL and a
StreamHandler); that is left alone here (it is not a vLLM patch), see `flashrl_root_handlers()`.

None of these can be switched off by an env var or a flag, but the markers make them stoppable:

* FlashRL already imported (usercustomize.py line, or an `import flash_rl` in user code): every
  patched object whose current value is FlashRL's function is put back to the original saved in its
  marker, and the marker stays so FlashRL never re-applies it;
* FlashRL not imported yet: the markers are set on the (unpatched) targets beforehand, so a later
  `import flash_rl` finds them and skips every patch ("already patched").

On an Ascend platform (torch_npu importable) or when `NPU_FLASHRL_YIELD_FLASHRL=1`, the registered
patch `flashrl_yield_to_npu_flashrl` does this, logging each site at INFO; npu_flashrl's own reload
adapter, sampler and lm-head handling then run without FlashRL's versions underneath or on top.
Apply it BEFORE npu_flashrl's other vLLM patches: a FlashRL function found under another wrapper is
not unwrapped (a WARNING names it).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import site
import sys
from typing import Dict, List, Optional

from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.patches import PatchNotApplicable
from npu_flashrl.values import env_switch

logger = get_logger(__name__)

PATCH_NAME = "flashrl_yield_to_npu_flashrl"
YIELD_ENV = "NPU_FLASHRL_YIELD_FLASHRL"  # 1: always yield, 0: never, unset: on Ascend only
FLASHRL_VERSIONS = "flash-llm-rl>=1.0,<1.1 (written against 1.0.3)"
FLASHRL_LOG_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


@dataclasses.dataclass(frozen=True)
class FlashRLSite:
    what: str          # human name
    module: str        # module to import
    owner: str         # attribute path of the owner inside module ("" = the module itself)
    attr: str          # patched attribute
    marker: str        # FlashRL's marker attribute on the owner


FLASHRL_SITES = (
    FlashRLSite("vllm.LLM.__init__ (config/model swap, load_weights reload wrapper, sampler patch)",
                "vllm", "LLM", "__init__", "beforeflashrl__init__"),
    FlashRLSite("vllm.LLM.__init__ (FLASHRL_TEST_RELOAD)", "vllm", "LLM", "__init__",
                "beforeflashrl_test__init__"),
    FlashRLSite("model_loader.utils.process_weights_after_loading",
                "vllm.model_executor.model_loader.utils", "", "process_weights_after_loading",
                "beforeflashrl_process_weights_after_loading"),
    FlashRLSite("model_loader.loader._process_weights_after_loading (older vLLM: module loader.py)",
                "vllm.model_executor.model_loader.loader", "", "_process_weights_after_loading",
                "beforeflashrl_process_weights_after_loading"),
    FlashRLSite("BaseModelLoader.load_model", "vllm.model_executor.model_loader.base_loader",
                "BaseModelLoader", "load_model", "beforeflashrl_load_model"),
    FlashRLSite("BaseKVCacheMethod.process_weights_after_loading",
                "vllm.model_executor.layers.quantization.kv_cache", "BaseKVCacheMethod",
                "process_weights_after_loading", "beforeflashrl_process_weights_after_loading"),
    FlashRLSite("Fp8LinearMethod.create_weights", "vllm.model_executor.layers.quantization.fp8",
                "Fp8LinearMethod", "create_weights", "beforeflashrl_create_weights"),
    FlashRLSite("Sampler.forward (fp32 logprobs)", "vllm.v1.sample.sampler", "Sampler", "forward",
                "beforeflashrl_forward"),
    FlashRLSite("VocabParallelEmbedding.__init__ (FLASHRL_LMHEAD_FP32)",
                "vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding",
                "__init__", "beforeflashrl_VocabParallelEmbedding"),
    FlashRLSite("UnquantizedEmbeddingMethod.apply (FLASHRL_LMHEAD_FP32)",
                "vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod",
                "apply", "beforeflashrl_apply"),
)


# ----------------------------------------------------------------------------- detection

def flashrl_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_rl") is not None
    except (ImportError, ValueError):
        return False


def flashrl_imported() -> bool:
    return "flash_rl" in sys.modules


def site_packages_dirs() -> List[str]:
    """Where FlashRL's setup may have written usercustomize.py (its own choice is getsitepackages()[0])."""
    dirs: List[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # old virtualenv's site.py
        pass
    try:
        user = site.getusersitepackages()
        if user:
            dirs.append(user)
    except AttributeError:
        pass
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _is_flashrl_import_line(line: str) -> bool:
    stripped = line.strip()
    return "import flash_rl" in stripped and not stripped.startswith("#")


def usercustomize_files(dirs: Optional[List[str]] = None) -> List[str]:
    """usercustomize.py files (in site dirs) with an active `import flash_rl` line."""
    found = []
    for d in dirs if dirs is not None else site_packages_dirs():
        path = os.path.join(d, "usercustomize.py")
        try:  # any bytes: only ASCII `import flash_rl` lines are looked for (cleanup reads it strictly)
            with open(path, encoding="utf-8", errors="replace") as f:
                if any(_is_flashrl_import_line(line) for line in f):
                    found.append(path)
        except OSError:
            continue
    return found


def detect_flashrl(dirs: Optional[List[str]] = None) -> Dict[str, object]:
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            ver: Optional[str] = version("flash-llm-rl")
        except PackageNotFoundError:
            ver = None
    except ImportError:  # pragma: no cover
        ver = None
    return {"installed": flashrl_installed(), "version": ver, "imported": flashrl_imported(),
            "usercustomize": usercustomize_files(dirs)}


def on_ascend() -> bool:
    """A real Ascend stack: torch_npu importable (npu_flashrl's CPU emulation does not count)."""
    try:
        from npu_flashrl.kernels import emulation
        return emulation.real_torch_npu_importable()
    except ImportError:
        try:
            return importlib.util.find_spec("torch_npu") is not None
        except (ImportError, ValueError):
            return False


def should_yield() -> bool:
    """NPU_FLASHRL_YIELD_FLASHRL: on / off, unset: on Ascend only; another word raises
    values.SwitchError naming the variable (never read as unset)."""
    value = env_switch(YIELD_ENV)
    return on_ascend() if value is None else value


# ----------------------------------------------------------------------------- neutralizing

def _is_flashrl_object(obj) -> bool:
    if isinstance(obj, functools.partial):
        return _is_flashrl_object(obj.func)
    fn = getattr(obj, "__func__", obj)
    return str(getattr(fn, "__module__", "") or "").startswith("flash_rl")


def _resolve_owner(s: FlashRLSite, import_missing: bool):
    if s.module not in sys.modules and not import_missing:
        return None
    try:
        owner = importlib.import_module(s.module)
    except Exception as exc:  # absent in this vLLM (e.g. model_loader.loader) or failing import
        logger.debug("FlashRL site %s: module %s not importable (%s)", s.what, s.module, exc)
        return None
    for part in filter(None, s.owner.split(".")):
        try:
            owner = getattr(owner, part, None)
        except Exception as exc:  # vllm's lazy attributes import on access (vllm.LLM needs fastapi)
            logger.debug("FlashRL site %s: %s.%s not importable (%s)", s.what, s.module, part, exc)
            return None
        if owner is None:
            return None
    if s.attr not in vars(owner) and not hasattr(owner, s.attr):
        return None
    return owner


def neutralize_flashrl(preempt: bool = True) -> Dict[str, str]:
    """Undo FlashRL's vLLM patches and keep them from being applied. Returns {site: action}.

    Actions: "restored" (FlashRL's function replaced by the original it saved), "preempted" (marker
    set before FlashRL patched), "kept-marker" (already neutral), "wrapped" (FlashRL's function sits
    under another wrapper: not touched, WARNING), "absent" (target not in this vLLM).
    """
    result: Dict[str, str] = {}
    # __init__ of vllm.LLM carries two markers; restore to the innermost original.
    for s in FLASHRL_SITES:
        key = f"{s.module}:{(s.owner + '.') if s.owner else ''}{s.attr} [{s.marker}]"
        owner = _resolve_owner(s, import_missing=preempt)
        if owner is None:
            result[key] = "absent"
            continue
        current = vars(owner).get(s.attr, getattr(owner, s.attr)) if isinstance(owner, type) \
            else getattr(owner, s.attr)
        saved = vars(owner).get(s.marker) if isinstance(owner, type) else getattr(owner, s.marker, None)
        if saved is not None and _is_flashrl_object(current):
            # Walk back through stacked FlashRL layers (LLM.__init__: test reload over config patch).
            original = saved
            for other in FLASHRL_SITES:
                if other.attr == s.attr and other.owner == s.owner and other.module == s.module:
                    cand = vars(owner).get(other.marker) if isinstance(owner, type) \
                        else getattr(owner, other.marker, None)
                    if cand is not None and not _is_flashrl_object(cand):
                        original = cand
            setattr(owner, s.attr, original)
            result[key] = "restored"
            logger.info("FlashRL yields to npu_flashrl: restored vLLM's %s (FlashRL's patch removed)", s.what)
        elif saved is not None:
            if _is_flashrl_object(patches.original(current)) or _wraps_flashrl(current):
                result[key] = "wrapped"
                logger.warning("FlashRL's patch of %s sits under another wrapper and was left in place: "
                               "apply %s before other vLLM patches", s.what, PATCH_NAME)
            else:
                result[key] = "kept-marker"
                logger.debug("FlashRL site %s already neutral", s.what)
        else:
            if not preempt:
                result[key] = "absent"
                continue
            setattr(owner, s.marker, current)
            result[key] = "preempted"
            logger.info("FlashRL yields to npu_flashrl: %s marked so `import flash_rl` will not patch it",
                        s.what)
    return result


def _wraps_flashrl(obj) -> bool:
    seen = 0
    while obj is not None and seen < 8:
        obj = getattr(obj, "__wrapped__", None)
        if obj is not None and _is_flashrl_object(obj):
            return True
        seen += 1
    return False


def flashrl_root_handlers() -> List[logging.Handler]:
    """Handlers FlashRL's import added to the ROOT logger (recognised by its format string)."""
    return [h for h in logging.getLogger().handlers
            if getattr(getattr(h, "formatter", None), "_fmt", None) == FLASHRL_LOG_FORMAT]


last_result: Dict[str, str] = {}


@patches.register(PATCH_NAME, "flash_rl:vllm_patch (vllm.LLM.__init__, process_weights_after_loading, "
                  "BaseModelLoader.load_model, kv-cache, Sampler.forward, lm-head fp32)", FLASHRL_VERSIONS,
                  when=())  # at activation: FlashRL patches vLLM as it is imported, this must come first
def _apply_yield() -> None:
    """Keep FlashRL 1.0.3's vLLM patches from fighting npu_flashrl's on Ascend (restore / pre-empt)."""
    if not should_yield():
        raise PatchNotApplicable(f"not on an Ascend platform: FlashRL's own patches are left active "
                                 f"(set {YIELD_ENV}=1 to make FlashRL yield anyway)")
    info = detect_flashrl()
    if not info["installed"] and not info["imported"]:
        logger.debug("FlashRL is not installed; nothing to yield")
        last_result.clear()
        return
    if info["version"] and not str(info["version"]).startswith("1.0."):
        logger.warning("FlashRL %s found; the yield patch was written against 1.0.3 and may miss new "
                       "patch sites", info["version"])
    last_result.clear()
    last_result.update(neutralize_flashrl(preempt=True))
    done = {k: v for k, v in last_result.items() if v in ("restored", "preempted")}
    logger.info("FlashRL %s (%s%s): %d vLLM patch site(s) neutralized",
                info["version"] or "?", "imported" if info["imported"] else "not imported",
                ", usercustomize.py import line present" if info["usercustomize"] else "", len(done))


def yield_flashrl() -> bool:
    """Apply the registered patch (idempotent)."""
    return patches.apply_patch(PATCH_NAME)
