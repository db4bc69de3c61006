"""The one home of an engine's INT8 choice: `EngineChoice`, carried in the engine's own config.

The engine patch (`vllm_engine.apply_entry`) decides, where a FlashRL config entry is applied to
an engine's arguments, what that engine runs, and writes it into
`additional_config["npu_flashrl"]`. vLLM pickles the VllmConfig to every process it starts
(EngineCore, mp workers), so the model build (`vllm_ascend.hooks.attach_on_init`) reads it from
the config it is given, never from a process global. An engine without a choice is not the
policy rollout: npu_flashrl leaves it exactly as vLLM / vllm-ascend build it.

While vLLM builds the config of an engine whose arguments carry a choice (`building`), the
choice is also visible to the two hooks that run inside that build and see no VllmConfig: the
compressed-tensors override (`ModelConfig`) and the quant-description redirect (`VllmConfig`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping, NamedTuple, Optional

CHOICE_KEY = "npu_flashrl"


class EngineChoice(NamedTuple):
    """What the FlashRL config entry chose for one engine.

    A NamedTuple, not a dataclass: vLLM hashes `additional_config` with `json.dumps` (a tuple
    serialises, a dataclass does not) and pickles it to its worker processes (both lines)."""

    fn: Optional[str]  # the online INT8 function; None: a 16-bit entry (no INT8 path)
    profile: Optional[str] = None  # path of the fn-int8 profile, loaded where the model is built
    rank: int = 0  # the DP group / verl replica whose entry this is
    # the entry's `group_size` (fn w4a8_profile_free); None: its default, or a W4A8 checkpoint's own
    group_size: Optional[int] = None

    @property
    def quantized(self) -> bool:
        return self.fn is not None

    @classmethod
    def of(cls, value: Any) -> Optional["EngineChoice"]:
        """`value` as a choice: an EngineChoice, or the same fields after a JSON round trip (a
        list, or a mapping); None for None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls(**{k: value[k] for k in cls._fields if k in value})
        if isinstance(value, (list, tuple)):
            return cls(*value)
        raise TypeError(f"additional_config[{CHOICE_KEY!r}] = {value!r} is not an npu_flashrl "
                        f"engine choice ({', '.join(cls._fields)})")


def choice_in(additional_config: Any) -> Optional[EngineChoice]:
    """The choice an `additional_config` dict carries, or None."""
    if not isinstance(additional_config, Mapping):
        return None
    return EngineChoice.of(additional_config.get(CHOICE_KEY))


def engine_choice(vllm_config: Any) -> Optional[EngineChoice]:
    """The choice of the engine `vllm_config` (a VllmConfig, or engine args) belongs to, or None
    (not the policy rollout)."""
    return choice_in(getattr(vllm_config, "additional_config", None))


def with_choice(additional_config: Optional[Mapping], choice: EngineChoice) -> dict:
    """A copy of `additional_config` (the user's keys kept) carrying `choice`."""
    out = dict(additional_config or {})
    out[CHOICE_KEY] = choice
    return out


_building: contextvars.ContextVar[Optional[EngineChoice]] = contextvars.ContextVar(
    "npu_flashrl_engine_choice_in_build", default=None)


@contextlib.contextmanager
def building(choice: Optional[EngineChoice]) -> Iterator[None]:
    """Around vLLM's build of one engine's config (ModelConfig + VllmConfig) from arguments that
    carry `choice`: the hooks inside that build see it (`choice_in_build`). Not a fallback: outside
    the build, and for an engine without a choice, there is none."""
    token = _building.set(choice)
    try:
        yield
    finally:
        _building.reset(token)


def choice_in_build() -> Optional[EngineChoice]:
    """The choice of the engine whose config vLLM is building right now, or None."""
    return _building.get()


def policy_in_build() -> bool:
    """True while vLLM builds the config of an INT8 policy-rollout engine."""
    choice = _building.get()
    return choice is not None and choice.quantized
