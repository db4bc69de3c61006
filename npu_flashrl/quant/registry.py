"""The one table of online INT8 functions: `fn` name -> quantizer class.

`register_quantizer(name)` fills it (a duplicate name is an error); `make_quantizer` and the
config's list of supported `fn` values both read it, so a new quantizer is one class, one place.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

QUANTIZERS: Dict[str, type] = {}


def register_quantizer(name: str) -> Callable[[type], type]:
    """Class decorator: make `cls` the quantizer for `fn: <name>`."""
    def deco(cls: type) -> type:
        if name in QUANTIZERS:
            raise ValueError(f"INT8 function {name!r} is already registered "
                             f"({QUANTIZERS[name].__module__}.{QUANTIZERS[name].__qualname__})")
        cls.name = name
        QUANTIZERS[name] = cls
        return cls
    return deco


def names() -> Tuple[str, ...]:
    """Registered `fn` names, in registration order."""
    return tuple(QUANTIZERS)


def quantizer_class(fn: str) -> type:
    """The quantizer class of config entry `fn`."""
    try:
        return QUANTIZERS[fn]
    except KeyError:
        raise ValueError(f"unknown INT8 function {fn!r}; known: {sorted(QUANTIZERS)}") from None


def make_quantizer(fn: str, compute_dtype, profile: Optional[dict] = None,
                   group_size: Optional[int] = None):
    """The quantizer for config entry `fn` (each class decides what its entry needs).
    `group_size`: the entry's key, for a quantizer with groups (refused for one without)."""
    cls = quantizer_class(fn)
    if group_size is None:
        return cls.from_entry(compute_dtype, profile)
    if cls.default_group_size is None:
        raise ValueError(f"fn {fn!r} has no weight groups; group_size = {group_size!r} applies to "
                         f"{', '.join(n for n, c in QUANTIZERS.items() if c.default_group_size)} only")
    return cls.from_entry(compute_dtype, profile, group_size=group_size)
