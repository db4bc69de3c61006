"""The `npu_flashrl` logger tree. Never touches the root logger (FlashRL 1.0.3 does; we do not).

FLASHRL_LOGGING_LEVEL (default INFO) and FLASHRL_LOGGING_FILE keep FlashRL's names and meaning but
apply to the `npu_flashrl` logger only.
"""
from __future__ import annotations

import logging
import os

ROOT_NAME = "npu_flashrl"
_configured = False


def get_logger(name: str | None = None) -> logging.Logger:
    """Logger `npu_flashrl` or `npu_flashrl.<name>`; configures the tree once from the env vars."""
    _configure()
    if not name or name == ROOT_NAME:
        return logging.getLogger(ROOT_NAME)
    if name.startswith(ROOT_NAME + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT_NAME}.{name}")


def _configure() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    logger = logging.getLogger(ROOT_NAME)
    level_name = os.environ.get("FLASHRL_LOGGING_LEVEL", "INFO").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        level = logging.INFO
        logging.getLogger(ROOT_NAME).warning(
            "FLASHRL_LOGGING_LEVEL=%r is not a logging level; using INFO", level_name)
    logger.setLevel(level)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_file = os.environ.get("FLASHRL_LOGGING_FILE")
    problem = None
    handler: logging.Handler
    if log_file:
        try:
            handler = logging.FileHandler(log_file)
        except OSError as exc:
            # a bad log path must not break every command (nor activation at import): stderr instead
            problem = f"FLASHRL_LOGGING_FILE={log_file!r}: cannot open it ({exc.strerror or exc}); logging to stderr"
            handler = logging.StreamHandler()
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    if problem:
        logger.warning("%s", problem)
    # Our handler prints; do not print twice through whatever the host configured on root.
    logger.propagate = False
