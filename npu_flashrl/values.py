"""How a verl config value reads as true or as unset, one rule for every check: verl configs
arrive as OmegaConf/dicts (True, None) or as Hydra override strings ("True", "null")."""
from __future__ import annotations

from typing import Any

NULLS = ("", "null", "none")


def is_true(value: Any) -> bool:
    """True, or a string that says true in any case."""
    return value is True or str(value).strip().lower() == "true"


def is_null(value: Any) -> bool:
    """None, or an empty / "null" / "none" string in any case."""
    return value is None or str(value).strip().lower() in NULLS
