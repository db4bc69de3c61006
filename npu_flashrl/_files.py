"""Which paths can be opened as files without waiting forever (no imports from the package).

Opening a FIFO blocks until the other end opens it, and reading a character device (a terminal,
/dev/stdin, /dev/zero) waits for input or never ends. Every vLLM worker and Ray process reads
FLASHRL_CONFIG, the profile and the model's shards, so such a path would hang all of them
without a word: the readers ask `special_file_problem` first and refuse the path by name.
"""
from __future__ import annotations

import os
import stat
from typing import Optional

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(path: str) -> Optional[str]:
    """What non-regular, non-directory file `path` is (symlinks followed), e.g. "a FIFO (named
    pipe)"; None for a regular file, a directory or a path that cannot be stat'ed (the caller's
    own open reports those)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None


def special_file_problem(path: str) -> Optional[str]:
    """Why `path` must not be opened for reading (None: a regular file, a directory, or missing).
    Said without opening it: opening a FIFO would already block."""
    kind = file_kind(path)
    if kind is None:
        return None
    if kind == _KINDS[0][1]:  # a FIFO: `--config <(cat file)` has a writer, and is still no file
        return (f"is {kind}, not a regular file: a pipe is read once, so the other processes that read "
                "this path (vLLM workers, Ray actors, a later check) would find it empty, and with no "
                "writer opening it waits forever; give the path of a file")
    return f"is {kind}, not a regular file (reading it would wait for input forever); give the path of a file"
