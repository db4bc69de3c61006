"""Which supported line the installed vllm-ascend is, decided once per process (`current()`).

A distribution's version decides (when vllm_ascend is imported from where it was installed):
- a verified release, or a post / local release of one (0.23.0.post1, 0.23.0+local): its line;
- a later release of a verified minor that is not verified itself (0.23.1, after 0.23.0): the
  newest verified line of that minor, with a WARNING naming the rules used;
- anything else: `UnsupportedVersion`, naming the supported releases.
A source tree (no metadata, or metadata of another copy) is recognised by its quantization files.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from typing import Optional, Tuple

from npu_flashrl._logging import get_logger
from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.lines import v0_10_1rc1, v0_11_0, v0_23_0
from npu_flashrl.lines.base import StackLine

# Oldest first; source-tree detection tries them in this order (each layout's files decide).
LINES: Tuple[StackLine, ...] = (v0_10_1rc1.LINE, v0_11_0.LINE, v0_23_0.LINE)

logger = get_logger(__name__)


class UnsupportedVersion(NpuFlashrlError, RuntimeError):
    """The installed vllm-ascend (or a named release) is not a supported line."""


def _all() -> Tuple[StackLine, ...]:
    return LINES


def supported() -> str:
    return ", ".join(ln.name for ln in _all())


# PEP 440 as vllm-ascend releases use it: N.N.N[{a,b,rc}N][.postN][.devN][+local]
_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:(a|b|rc)(\d+))?(?:\.post\d+)?(?:\.dev(\d+))?(?:\+.*)?$")
_PRE_ORDER = {"a": 0, "b": 1, "rc": 2, None: 3}


def parse(version: str) -> Optional[Tuple[Tuple[int, int, int], Tuple[int, int], Optional[int]]]:
    """(release, pre-release order, dev) of a version string; None when it is not of that form.
    Post and local parts are dropped: the same code, rebuilt or repackaged."""
    m = _VERSION.match(version.strip())
    if m is None:
        return None
    major, minor, micro, pre, pre_n, dev = m.groups()
    return (int(major), int(minor), int(micro)), (_PRE_ORDER[pre], int(pre_n or 0)), \
        None if dev is None else int(dev)


def _refused(version: str) -> UnsupportedVersion:
    return UnsupportedVersion(f"vllm-ascend {version} is not supported; npu_flashrl supports "
                              f"vllm-ascend {supported()} (see npu_flashrl/pins.yaml)")


def line_for_version(version: str) -> StackLine:
    """The line of a vllm-ascend release string; UnsupportedVersion names the supported ones."""
    have = parse(version)
    if have is None:
        raise _refused(version)
    release, pre, dev = have
    same_minor = []
    for ln in _all():
        want = parse(ln.name)
        if (release, pre, dev) == want:
            return ln
        if release[:2] == want[0][:2]:
            same_minor.append((want, ln))
    later = [(w, ln) for w, ln in same_minor if dev is None and (release, pre) > (w[0], w[1])]
    if not later:
        raise _refused(version)
    _, ln = max(later, key=lambda wl: (wl[0][0], wl[0][1]))
    logger.warning("npu_flashrl: vllm-ascend %s is not a verified release; using the rules of the "
                   "vllm-ascend %s line (its minor's newest verified release). Verified: %s",
                   version, ln.name, supported())
    return ln


def line_for_tree(package_dir: str) -> StackLine:
    """The line of a vllm_ascend package directory, from the files only its layout has."""
    quant = os.path.join(package_dir, "quantization")
    for ln in _all():
        if ln.matches_tree(quant):
            return ln
    raise UnsupportedVersion(f"cannot tell the vllm-ascend version of the tree at {package_dir} "
                             f"(its quantization/ matches no known layout); npu_flashrl supports "
                             f"vllm-ascend {supported()}")


def _dist_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def current() -> StackLine:
    """The installed vllm-ascend's line, decided once per process.

    The distribution's version decides when vllm_ascend is imported from where the distribution
    was installed; a source tree on PYTHONPATH (no metadata, or metadata of another copy) is
    recognised by its quantization layout."""
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None:
        raise UnsupportedVersion(f"vllm_ascend is not installed; npu_flashrl supports vllm-ascend "
                                 f"{supported()}")
    package_dir = list(spec.submodule_search_locations or [])[0]
    version = _dist_version("vllm_ascend") or _dist_version("vllm-ascend")
    if version is not None and "site-packages" in package_dir:
        ln = line_for_version(version)
        verified = parse(version) == parse(ln.name)
        return dataclasses.replace(ln, source=f"distribution {version}" + (
            "" if verified else f" (unverified: the vllm-ascend {ln.name} line's rules)"))
    return dataclasses.replace(line_for_tree(package_dir), source=f"source tree {package_dir}")
