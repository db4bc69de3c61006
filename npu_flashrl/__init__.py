"""npu_flashrl: FlashRL-style INT8 rollouts for RL of LLMs on Huawei Ascend NPUs.

`import npu_flashrl` with FLASHRL_CONFIG set activates it (as `import flash_rl` does for FlashRL);
vLLM processes also activate it through the `vllm.general_plugins` entry point.
"""
import os

__version__ = "0.1.0"
# Why activation at import failed (None: it did not fail, or did not run); `npu-flashrl verify` shows it.
activation_error = None


def activate(config_path=None):
    """Apply npu_flashrl's patches for the FlashRL config (argument or FLASHRL_CONFIG)."""
    from npu_flashrl.activation import activate as _activate

    return _activate(config_path)


if os.environ.get("FLASHRL_CONFIG", "").strip() and os.environ.get("NPU_FLASHRL_NO_AUTOACTIVATE") != "1":
    try:
        activate()
    except Exception as _exc:  # noqa: BLE001 - reported, and raised again by the vLLM plugin
        from npu_flashrl._logging import get_logger

        activation_error = f"{type(_exc).__name__}: {_exc}"
        get_logger().error("npu_flashrl: activation from FLASHRL_CONFIG failed: %s", _exc)
