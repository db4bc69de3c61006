"""The `npu_flashrl` logger tree. Never touches the root logger (FlashRL 1.0.3 does; we do not).

Loggers are named `npu_flashrl.<module>` (`get_logger(__name__)`) and propagate to the root, so a
user's or verl's logging config sees our lines; with none, Python's last-resort handler prints
WARNING and above on stderr.

FLASHRL_LOGGING_LEVEL and FLASHRL_LOGGING_FILE keep FlashRL's names and meaning but apply to the
`npu_flashrl` logger only: when either is set, that logger gets its own handler (the file, or
stderr) at that level (default INFO) and stops propagating, so a line is not printed twice.
"""
from __future__ import annotations

import logging
import os

from npu_flashrl import _files

ROOT_NAME = "npu_flashrl"
LEVEL_ENV = "FLASHRL_LOGGING_LEVEL"
FILE_ENV = "FLASHRL_LOGGING_FILE"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_configured = False


class _FileHandler(logging.FileHandler):
    """FLASHRL_LOGGING_FILE's handler: the first record it cannot write (a full disk, /dev/full, a
    closed file) moves the npu_flashrl logger to stderr with one WARNING naming the variable and
    the error, instead of logging's traceback on every line."""

    def handleError(self, record: logging.LogRecord) -> None:
        import sys

        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            return super().handleError(record)
        logger = logging.getLogger(ROOT_NAME)
        if self not in logger.handlers:
            return
        logger.removeHandler(self)
        try:
            self.close()
        except OSError:
            pass
        fallback = logging.StreamHandler()
        fallback.setFormatter(self.formatter)
        logger.addHandler(fallback)
        logger.warning("%s=%r: cannot write to it (%s); logging to stderr", FILE_ENV, self.baseFilename,
                       exc.strerror or exc)
        fallback.handle(record)


def get_logger(name: str | None = None) -> logging.Logger:
    """Logger `npu_flashrl` or `npu_flashrl.<name>` (a module's `__name__` is used as it is);
    configures the tree once from the env vars."""
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
    level_name = os.environ.get(LEVEL_ENV, "").strip()
    log_file = os.environ.get(FILE_ENV, "").strip()
    if not level_name and not log_file:
        return  # propagate to whatever the host configured (or Python's last resort)
    logger = logging.getLogger(ROOT_NAME)
    problems = []
    level = logging.getLevelName(level_name.upper()) if level_name else logging.INFO
    if not isinstance(level, int):
        level = logging.INFO
        problems.append(f"{LEVEL_ENV}={level_name!r} is not a logging level; using INFO")
    logger.setLevel(level)
    handler: logging.Handler
    kind = _files.file_kind(log_file) if log_file else None
    if kind and kind != "a character device":  # /dev/null or a terminal are fine; a FIFO blocks the open
        problems.append(f"{FILE_ENV}={log_file!r}: is {kind}, not a regular file (opening it would wait for a "
                        f"reader forever); logging to stderr")
        handler = logging.StreamHandler()
    elif log_file:
        try:
            handler = _FileHandler(log_file)
        except OSError as exc:
            # a bad log path must not break every command (nor activation at import): stderr instead
            problems.append(f"{FILE_ENV}={log_file!r}: cannot open it ({exc.strerror or exc}); logging to stderr")
            handler = logging.StreamHandler()
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    # Our handler prints; do not print twice through whatever the host configured on root.
    logger.propagate = False
    for problem in problems:
        logger.warning("%s", problem)
