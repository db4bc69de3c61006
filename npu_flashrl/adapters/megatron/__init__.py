"""Megatron / MindSpeed trainer side: import order, weight stream to the INT8 rollout, FP32 lm-head.

Written against the sync-mode verl the pinned line pins (`lines.SYNC_PIN`), megatron-core 0.12.1 and
MindSpeed (source install at the pinned commit). Nothing here imports Megatron, MindSpeed or verl at
module import time: ``npu_flashrl.adapters.load_all()`` imports this package in every process.

* ``import_guard``: MindSpeed's adaptor before Megatron. The guard (every process, FSDP ones too:
  verl imports Megatron in every worker) only puts the adaptor first when MindSpeed is installed; the
  strict check (missing MindSpeed on NPU, wrong order, broken MindSpeed) runs where a Megatron model is
  built.
* ``workers``: the patch ``megatron_mindspeed_guard`` on verl's Megatron worker ``__init__`` (strict
  check, FP32 lm-head, refusal of ``use_fused_kernels=True`` with ``FLASHRL_LMHEAD_FP32=1``).
* ``stream``: the patch ``megatron_weight_stream`` on verl's ``per_tensor_generator`` and the one
  conversion/validation point :func:`megatron_to_hf_stream` (dense architectures only; others get
  "INT8 rollout does not support <arch>").
* ``output_layer``: the patch ``megatron_lmhead_fp32`` (fp32 logits of ``output_layer``).
* ``engine``: server-mode verl's Megatron / MindSpeed engine (current line): the patches
  ``megatron_engine_checks`` (MindSpeed check, refusals by name) and ``megatron_engine_lmhead_fp32``
  on ``MegatronEngine``; the pinned-line worker and stream patches above do not apply there.

User-facing description: docs/megatron.md.
"""
from npu_flashrl.config import lmhead_fp32_requested  # noqa: F401  (re-exported)
from npu_flashrl.adapters.megatron._common import (ADAPTOR, PATCH_GUARD, PATCH_LMHEAD, PATCH_STREAM, PATCHES,
                                                   VERL_PIN, WORKER_CLASSES, WORKER_MODULE, when_imported)
from npu_flashrl.adapters.megatron.engine import (ENGINE_PATCHES, INT8_ARCHITECTURES,
                                                     PATCH_ENGINE_CHECKS, PATCH_ENGINE_LMHEAD,
                                                     check_engine)
from npu_flashrl.adapters.megatron.import_guard import (RAY_HOOK, RAY_HOOK_OVERRIDE, MindSpeedError,
                                                        MindSpeedImportOrderError, MindSpeedMissingError,
                                                        ensure_mindspeed_before_megatron, import_order,
                                                        install_import_guard)
from npu_flashrl.adapters.megatron.output_layer import (MARK, FusedKernelsConflict, check_fused_kernels,
                                                        disable_fp32_output_layer, enable_fp32_output_layer,
                                                        is_fp32_output_layer)
from npu_flashrl.adapters.megatron.stream import (DENSE_ARCHITECTURES, UnsupportedArchitectureError,
                                                  WeightStreamError, architecture, hf_shapes, is_dense_supported,
                                                  megatron_to_hf_stream, pp_layer_offset)
from npu_flashrl.adapters.megatron.workers import worker_process_setup

__all__ = [
    "MindSpeedError", "MindSpeedMissingError", "MindSpeedImportOrderError", "WeightStreamError",
    "UnsupportedArchitectureError", "FusedKernelsConflict",
    "ensure_mindspeed_before_megatron", "install_import_guard", "import_order", "worker_process_setup",
    "megatron_to_hf_stream", "hf_shapes", "pp_layer_offset", "architecture", "is_dense_supported",
    "DENSE_ARCHITECTURES", "check_fused_kernels",
    "enable_fp32_output_layer", "disable_fp32_output_layer", "is_fp32_output_layer",
    "lmhead_fp32_requested", "PATCHES", "PATCH_GUARD", "PATCH_STREAM", "PATCH_LMHEAD", "RAY_HOOK",
    "RAY_HOOK_OVERRIDE", "ENGINE_PATCHES", "PATCH_ENGINE_CHECKS", "PATCH_ENGINE_LMHEAD",
    "INT8_ARCHITECTURES", "check_engine", "ADAPTOR", "VERL_PIN", "WORKER_MODULE", "WORKER_CLASSES", "MARK", "when_imported",
]
