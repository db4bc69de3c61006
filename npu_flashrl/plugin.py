"""vLLM general plugin (`vllm.general_plugins` entry point `npu_flashrl`).

vLLM loads general plugins in every process it starts (the engine, each worker, each Ray actor),
so setting FLASHRL_CONFIG in the job's environment is enough: no `import` in the driver needed.
"""
from npu_flashrl._logging import get_logger

logger = get_logger(__name__)


def register() -> None:
    from npu_flashrl.activation import activate

    result = activate()
    if result is None:
        logger.debug("npu_flashrl plugin loaded; FLASHRL_CONFIG not set, nothing to do")
