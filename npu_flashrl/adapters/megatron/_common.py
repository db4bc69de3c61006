"""Names shared by the Megatron adapter's modules. They patch verl's Megatron worker module without
importing it (importing it imports Megatron) through `patches.when_imported`."""
from __future__ import annotations

import sys

from npu_flashrl import lines
from npu_flashrl._logging import get_logger
from npu_flashrl.patches import when_imported  # noqa: F401  (re-exported for the adapter's modules)

logger = get_logger("adapters.megatron")

VERL_PIN = lines.SYNC_PIN
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
