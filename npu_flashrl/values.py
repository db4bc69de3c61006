"""How a verl config value reads as true or as unset, one rule for every check: verl configs
arrive as OmegaConf/dicts (True, None) or as Hydra override strings ("True", "null")."""
from __future__ import annotations

from typing import Any

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
