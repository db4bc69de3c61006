"""One module per outside system: vllm_ascend (INT8 layers, reload), vllm_engine (engine config),
vllm_lm_head (FP32 lm-head), flashrl (coexistence), verl (TIS, metrics; sync ends: verl.sync_mode, and
verl.server_mode for the server-mode verl lines, verl.checkpoint_engine for its checkpoint engines and
the INT8 wire), transformers (trainer lm-head),
megatron (MindSpeed / Megatron trainer side)."""
import importlib

from npu_flashrl.adapters.registry import registered

# every adapter module, each declaring when it applies in `registry`
ADAPTERS = tuple(spec.name for spec in registered())


def load_all():
    """Import every adapter so its patches are declared (for `npu-flashrl verify`). Adapters import
    upstream code lazily, inside their patch functions, so this is cheap and never fails on a
    missing upstream package."""
    loaded = []
    for name in ADAPTERS:
        try:
            importlib.import_module(f"npu_flashrl.adapters.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"npu_flashrl.adapters.{name}":
                raise
            continue
        loaded.append(name)
    return loaded
