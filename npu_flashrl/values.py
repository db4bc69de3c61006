"""How a verl config value reads as true or as unset, one rule for every check: verl configs
arrive as OmegaConf/dicts (True, None) or as Hydra override strings ("True", "null")."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from npu_flashrl.errors import NpuFlashrlError

NULLS = ("", "null", "none")


def is_true(value: Any) -> bool:
    """As verl's `if value:` reads a Hydra-typed value: True, a non-zero number (Hydra types
    `bypass_mode=1` as the int 1), or a string that says true in any case or is a non-zero number."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    text = str(value).strip().lower()
    if text == "true":
        return True
    try:
        return float(text) != 0
    except ValueError:
        return False


def is_null(value: Any) -> bool:
    """None, or an empty / "null" / "none" string in any case."""
    return value is None or str(value).strip().lower() in NULLS


SWITCH_TRUE = ("1", "true", "yes", "on")
SWITCH_FALSE = ("0", "false", "no", "off")


class SwitchError(NpuFlashrlError, ValueError):
    """An environment switch set to a word that is neither on nor off."""


def env_switch(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """A three-way environment switch: True (1/true/yes/on), False (0/false/no/off), None (unset or
    empty), any case. Anything else raises SwitchError naming the variable: never read as unset."""
    raw = (os.environ if environ is None else environ).get(name)
    text = "" if raw is None else str(raw).strip().lower()
    if text == "":
        return None
    if text in SWITCH_TRUE:
        return True
    if text in SWITCH_FALSE:
        return False
    raise SwitchError(f"{name}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off), "
                      f"or unset for the default")
