"""The schemes the in-place reload knows, keyed like vllm-ascend's own registry: (quant type,
layer type) -> scheme. `register_scheme` is the one door in; `find_targets` walks a model and asks
each registered scheme which layers are its."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple, Type

import torch

from npu_flashrl import lines
from npu_flashrl.adapters.vllm_ascend.schemes.base import (
    LINEAR, MOE, Scheme, UnsupportedScheme, inner_method)

_SCHEMES: Dict[Tuple[str, str], Scheme] = {}


def register_scheme(quant_type: str, layer_type: str) -> Callable[[Type[Scheme]], Type[Scheme]]:
    """Class decorator: register one instance of the scheme under (quant_type, layer_type)."""
    if layer_type not in (LINEAR, MOE):
        raise ValueError(f"layer type {layer_type!r}: expected {LINEAR!r} or {MOE!r}")

    def register(cls: Type[Scheme]) -> Type[Scheme]:
        key = (quant_type, layer_type)
        if key in _SCHEMES and type(_SCHEMES[key]) is not cls:
            raise ValueError(f"scheme {key} registered twice ({type(_SCHEMES[key]).__name__}, "
                             f"{cls.__name__})")
        cls.quant_type, cls.layer_type = quant_type, layer_type
        _SCHEMES[key] = cls()
        return cls
    return register


def get_scheme(quant_type: str, layer_type: str) -> Scheme:
    try:
        return _SCHEMES[(quant_type, layer_type)]
    except KeyError:
        raise UnsupportedScheme(f"no in-place reload for vllm-ascend {quant_type} {layer_type} "
                                f"layers (registered: {sorted(_SCHEMES)})") from None


def registered(layer_type: str = "") -> List[Scheme]:
    """The registered schemes (of `layer_type` only, when given), in registration order."""
    return [s for s in _SCHEMES.values() if not layer_type or s.layer_type == layer_type]


def supported(layer_type: str = "") -> List[str]:
    """The quant types the reload serves (of `layer_type` only, when given): the registry."""
    return [s.quant_type for s in registered(layer_type)]


def once_patches(line) -> list:
    """The run-once patch of every registered scheme on `line` (one per key)."""
    return [s.once_patch(line) for s in registered()]


def method_patches(line) -> list:
    """Every registered scheme's other patches of its method class on `line` (`method_patches`)."""
    return [p for s in registered() for p in s.method_patches(line)]


def find_targets(model: torch.nn.Module, layer_type: str) -> Dict[str, object]:
    """HF weight name -> target of every `layer_type` layer of `model` that a registered scheme
    claims. A linear layer under vllm-ascend's wrapper that no scheme claims is refused (its
    projections would otherwise pass through to vLLM's loaders, and float weights would land in
    int8 parameters)."""
    line = lines.current()
    schemes = registered(layer_type)
    runs: List[Tuple[Scheme, List[Tuple[str, torch.nn.Module]]]] = []  # in the model's order
    wrapper = line.linear_wrapper_class() if layer_type == LINEAR else None
    for path, module in model.named_modules():
        inner = inner_method(module)
        if inner is None:
            continue
        refused = line.refused_reason(inner)
        if refused is not None:
            raise UnsupportedScheme(f"{path}: {refused}")
        scheme = next((s for s in schemes if s.claims(inner, line)), None)
        if scheme is not None:
            if runs and runs[-1][0] is scheme:
                runs[-1][1].append((path, module))
            else:
                runs.append((scheme, [(path, module)]))
        elif wrapper is not None and isinstance(getattr(module, "quant_method", None), wrapper):
            claimed = [c.__name__ for c in (s.method_class(line) for s in schemes) if c is not None]
            raise UnsupportedScheme(f"{path}: {line.unsupported_reason(inner, claimed)}")
    targets: Dict[str, object] = {}
    for scheme, layers in runs:
        targets.update(scheme.targets(model, layers))
    return targets
