"""verl's Megatron workers: the strict MindSpeed check and set-up checks where a Megatron model is built.

The registered patch ``megatron_mindspeed_guard`` installs the import guard and wraps the ``__init__``
of verl's Megatron workers (``ActorRolloutRefWorker``, ``CriticWorker``, ``RewardModelWorker`` in
``verl.workers.megatron_workers``). In each worker process that builds a Megatron model it runs, before
verl's own ``repatch``: :func:`ensure_mindspeed_before_megatron` (order; missing MindSpeed on NPU, by
``verl.utils.device.is_npu_available``, is an error here and only here), the FP32 lm-head patch when
``FLASHRL_LMHEAD_FP32=1`` (refused together with ``use_fused_kernels=True``), and a WARNING when
``use_mbridge=True`` (verl's mbridge stream bypasses ``megatron_weight_stream``). Applying the patch
never imports verl's worker module (that would import Megatron): if it is not imported yet, the wrap is
deferred to its import (a post-import hook), so the patch is safe in FSDP and vLLM processes.

The wrap exists only in processes where npu_flashrl was activated BEFORE verl's worker module was
imported: in verl's Ray workers that is Ray's ``worker_process_setup_hook``
(``npu_flashrl.activation.worker_process_setup``; the recipes set it). Without it, nothing of this runs
in trainer workers: the vLLM general plugin activates npu_flashrl only when the rollout engine is built,
after the workers' ``__init__``.
"""
from __future__ import annotations

from typing import Optional

from npu_flashrl import lines, patches
from npu_flashrl.marks import marked
from npu_flashrl.adapters.megatron import _common
from npu_flashrl.adapters.megatron._common import (PATCH_GUARD, PATCH_LMHEAD, PATCHES, WORKER_CLASSES,
                                                   WRAPPED, logger, when_imported)
from npu_flashrl.adapters.megatron.import_guard import ensure_mindspeed_before_megatron, install_import_guard
from npu_flashrl.adapters.megatron.output_layer import _get, check_fused_kernels
from npu_flashrl.config import lmhead_fp32_requested
from npu_flashrl.patches import register


def _worker_device() -> Optional[str]:
    try:
        from verl.utils.device import is_npu_available
    except Exception:  # noqa: BLE001
        return None
    return "npu" if is_npu_available else "cpu"


def _check_config(config) -> None:
    """Set-up checks on the worker's ``actor_rollout_ref`` config (other workers: nothing to check)."""
    if config is None or _get(config, "actor") is None:
        return
    check_fused_kernels(config)
    bridge = _get(config, "actor", "megatron", "use_mbridge")
    if bridge is True or str(bridge).lower() == "true":
        logger.warning("npu_flashrl: actor.megatron.use_mbridge=True: verl sends bridge.export_weights(...) to "
                       "the rollout instead of per_tensor_generator, so npu_flashrl's weight-stream check "
                       "(megatron_to_hf_stream) does not run; the INT8 reload still checks each tensor's name "
                       "and shape")


def _wrap_worker_init(original):
    def __init__(self, *args, **kwargs):
        ensure_mindspeed_before_megatron(_worker_device())
        _check_config(args[0] if args else kwargs.get("config"))
        if lmhead_fp32_requested():
            patches.apply_patch(PATCH_LMHEAD)
        return original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    setattr(__init__, WRAPPED, True)
    return __init__


def _patch_worker_module(module) -> None:
    for cls_name in WORKER_CLASSES:
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue
        init = cls.__dict__.get("__init__")
        if init is None or marked(init, WRAPPED):
            continue
        new = _wrap_worker_init(init)
        setattr(new, patches.ORIGINAL_ATTR, init)
        cls.__init__ = new


@register(PATCH_GUARD, f"{_common.WORKER_MODULE}:ActorRolloutRefWorker.__init__ (+CriticWorker, RewardModelWorker)",
          lines.versions("verl", verl_mode="sync"),
          doc="Megatron workers check MindSpeed was imported before Megatron (error on NPU without MindSpeed)",
          when=())  # at activation: the import guard must be in place before anything imports Megatron
def _apply_guard() -> None:
    install_import_guard()
    when_imported(_common.WORKER_MODULE, _patch_worker_module)


def worker_process_setup() -> None:
    """Ray ``worker_process_setup_hook`` for the Megatron side alone (no FLASHRL_CONFIG needed): import
    guard + verl Megatron worker patches. With an INT8 rollout use ``npu_flashrl.activation.worker_process_setup``
    (what the recipes set), which does this and activates the rest."""
    install_import_guard()
    for name in PATCHES:
        patches.apply_patch(name)
