"""The stack lines npu_flashrl supports, one module each, and which one is installed.

Every upstream version difference lives here and nowhere else in the package (a test greps for
version literals outside `lines/` and `pins.yaml`):

- `base.StackLine`: what a line is (detection data, vllm-ascend class paths and layout rules, its
  patches as objects, facts the CPU simulation reads); behaviour shared by every line;
- `v0_10_1rc1` (the production pin), `v0_11_0`, `v0_23_0`: one `LINE` each;
- `detect`: `current()`, the installed line (the one door to it: no other module decides it) (post / local releases of a verified release are that
  line; a later patch release of a verified minor gets its rules with a WARNING; anything else is
  refused naming the supported releases);
- `verl`: the verl config line and how the installed verl drives its rollout.

Adding a line: a module with its `LINE` (subclassing the nearest line's class for what it
shares), listed in `detect.LINES`; its pins in pins.yaml.
"""
from __future__ import annotations

from typing import Optional

from npu_flashrl.lines.base import (  # noqa: F401
    GET_QUANT_CONFIG_TARGET, INITIALIZE_MODEL_TARGET, POLICY_ATTR, PROCESSED_ATTR, SYNC_ATTR,
    PatchBodies,
    StackLine, resolve)
from npu_flashrl.lines.detect import (  # noqa: F401
    LINES, UnsupportedVersion, current, line_for_tree, line_for_version, supported)
from npu_flashrl.lines import verl  # noqa: F401
from npu_flashrl.lines.verl import SYNC_PIN, VERL_ALIASES, VERL_LINES  # noqa: F401

SUPPORTED_VLLM_ASCEND = tuple(ln.name for ln in LINES)


def by_name(name: str) -> StackLine:
    """The supported line of vllm-ascend release `name` (exactly)."""
    for ln in LINES:
        if ln.name == name:
            return ln
    raise UnsupportedVersion(f"no vllm-ascend line {name!r}; npu_flashrl supports {supported()}")


def by_label(label: str) -> StackLine:
    """The line users, pins.yaml and the CPU test stack call `label` ("pinned", "0.11", "current")."""
    for ln in LINES:
        if ln.label == label:
            return ln
    raise UnsupportedVersion(f"no stack line {label!r}; the lines are "
                             f"{', '.join(ln.label for ln in LINES)}")


def versions(*packages: str, verl_mode: Optional[str] = None) -> str:
    """The releases a patch serving every line (or every line of `verl_mode`: "sync" / "server")
    supports, for `verify`: e.g. versions("vllm") -> "vllm 0.10.1, 0.11.0, 0.23.0";
    packages: "vllm", "vllm-ascend", "verl"."""
    field = {"vllm": "vllm", "vllm-ascend": "vllm_ascend", "verl": "verl"}
    chosen = [ln for ln in LINES if verl_mode is None or ln.verl_mode == verl_mode]
    return "; ".join(f"{p} " + ", ".join(getattr(ln, field[p]) for ln in chosen) for p in packages)


def verl_server_mode() -> bool:
    """`verl.verl_server_mode`, looked up at call time (tests replace `lines.verl.verl_server_mode`)."""
    return verl.verl_server_mode()


def verl_line(name: Optional[str] = None) -> str:
    """`verl.verl_line`: the verl config line `name` normalised, or the installed verl's."""
    return verl.verl_line(name)
