"""verl's own validation of a launch command, offline: the job's config composed the way the
installed verl's entry point composes it (Hydra's compose API over verl's own config tree in the
installed package, the command's overrides typed as Hydra types them, interpolations resolved as
OmegaConf resolves them), then verl's own checks called on it on the CPU:

* ``verl.utils.config.validate_config`` (what ``verl.trainer.main_ppo.main`` and the one-step-off /
  fully-async task runners call before anything starts: the batch sizes against the NPUs, the actor
  config's ``__post_init__`` and ``validate``, the micro-batch settings of ref and rollout);
* the rollout config and its checkpoint engine's through ``omega_conf_to_dataclass`` (their
  ``__post_init__``, as verl's agent loop and trainer build them; the ref's section is renamed
  inside its worker before it is built, so it is checked through the actor's rules only);
* the actor update's mini-batch split (``micro_batch_problems``): what the server line's verl
  asserts only at the first update, after the first rollout, on its main entry point;
* the experimental entry points' own preparation (``rollout.nnodes`` / ``rollout.n_gpus_per_node``
  copied into ``actor_rollout_ref.rollout``, as their ``main`` does) and the fully-async trainer's
  ``async_training`` section.

Nothing of verl's config rules is copied here: each message is verl's own exception text, prefixed
with the check that raised it. The one exception is the mini-batch split, which verl checks only on
the data of a running update in modules that import its whole engine stack: that arithmetic is
done here, and a test holds it to verl's own `prepare_micro_batches`. Imports verl (and so torch): `check` runs only when the installed verl
runs the recipe's config line.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import os
import warnings
from typing import Any, List, Optional, Tuple

from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.recipes.command import Command


def verl_dir() -> Optional[str]:
    """The installed verl package's directory (without importing it), or None."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def config_source(cmd: Command, root: str) -> Tuple[str, str]:
    """(config dir, config name) the command's entry point hands to `hydra.main`."""
    if cmd.experimental:
        parts = verl_lines.ENTRY_EXPERIMENTAL[cmd.entry]
        own = os.path.splitext(parts[-1])[0]
        name = own if cmd.config_name == "ppo_trainer" else cmd.config_name
        return os.path.join(root, *parts[:-1]), name
    return os.path.join(root, "trainer", "config"), cmd.config_name


def compose(cmd: Command, root: str) -> Any:
    """The job's DictConfig, composed by Hydra as the entry point's `hydra.main` composes it.
    The one-step-off trainer's YAML names verl's config tree relative to the working directory
    (``file://verl/trainer/config``): here it is the installed package's tree."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir, name = config_source(cmd, root)
    overrides = list(cmd.overrides)
    if cmd.experimental:
        overrides.append(f"hydra.searchpath=[file://{os.path.join(root, 'trainer', 'config')}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return hydra_compose(config_name=name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


@functools.lru_cache(maxsize=8)
def _defaults(entry: Optional[str], config_name: str, root: str) -> Any:
    """verl's own config for an entry point, without overrides (read only)."""
    return compose(Command(entry, {}, config_name, []), root)


def typed_as_strings(cmd: Command, root: str, config: Any) -> List[str]:
    """Overrides Hydra types as a string where verl's own default is a number or a boolean (e.g.
    ``0x4``, which YAML 1.1 reads as 4 but Hydra's grammar keeps as the text '0x4'): verl's
    dataclasses do not convert them, and the job fails (or compares a string) later."""
    from omegaconf import OmegaConf

    base = _defaults(cmd.entry, cmd.config_name, root)
    problems: List[str] = []
    seen = set()
    for ov in reversed(cmd.overrides):  # the last override of a key is the one Hydra keeps
        key, sep, text = ov.partition("=")
        if not sep or key.startswith(("+", "~")) or key in seen:
            continue
        seen.add(key)
        want = OmegaConf.select(base, key, default=None)
        got = OmegaConf.select(config, key, default=None)
        if isinstance(want, (bool, int, float)) and isinstance(got, str):
            kind = "True or False" if isinstance(want, bool) else type(want).__name__
            problems.insert(0, f"{ov}: Hydra reads {text!r} as the string {got!r}, but verl's {key} is "
                            f"{kind} (its default: {want!r}); write it as a plain {kind}")
    return problems


VALIDATE = "verl.utils.config.validate_config"
SPLIT = "the actor update's mini-batch split"


def _raise(problems: List[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:1200]


def _reference_policy(config: Any, line: str) -> Tuple[bool, Optional[str]]:
    """(use_reference_policy, note) as the entry point computes it: the server-mode line's
    `need_reference_policy(config)`; the sync (pinned) line's asks the role-worker mapping, which the task
    runner fills with a ref worker when the KL loss or the in-reward KL is on
    (`add_ref_policy_worker`)."""
    if verl_lines.is_server_line(line):
        try:
            from verl.trainer.ppo.utils import need_reference_policy
        except ImportError as exc:  # e.g. verl's dataset module without `datasets` installed
            note = (f"verl.trainer.ppo.utils is not importable here ({exc}): the ref policy is taken "
                    "as on when actor.use_kl_loss or algorithm.use_kl_in_reward is set")
        else:
            return bool(need_reference_policy(config)), None
    else:
        note = None
    actor = config.actor_rollout_ref.actor
    return bool(config.algorithm.get("use_kl_in_reward", False) or actor.get("use_kl_loss", False)), note


def _critic(config: Any) -> Tuple[bool, Optional[str]]:
    try:
        from verl.trainer.ppo.utils import need_critic
    except ImportError as exc:
        enable = config.critic.get("enable", None)
        return (bool(enable) if enable is not None else config.algorithm.adv_estimator == "gae"), (
            f"verl's need_critic is not importable here ({exc}): critic taken as "
            "critic.enable, else adv_estimator == gae")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(need_critic(config)), None


def _data_parallel_size(actor: Any, n_gpus: int) -> Optional[int]:
    """The actor engine's data-parallel size on `n_gpus` trainer NPUs, from verl's own actor
    dataclass (`actor`: its `engine` config carries the Ulysses size its __post_init__ synced,
    Megatron's the model-parallel sizes); None where the engine's layout is not read here."""
    engine = getattr(actor, "engine", None)
    if getattr(actor, "strategy", "") == "megatron":
        sizes = [getattr(engine, k, 1) or 1 for k in ("tensor_model_parallel_size",
                                                     "pipeline_model_parallel_size", "context_parallel_size")]
        if getattr(engine, "dynamic_context_parallel", False):
            return 1  # verl's Megatron engine then answers dp = 1
    else:
        sizes = [getattr(engine, "ulysses_sequence_parallel_size", 1) or 1]
    model = 1
    for size in sizes:
        model *= int(size)
    return n_gpus // model if model and n_gpus % model == 0 else None


def micro_batch_problems(config: Any) -> List[str]:
    """The actor's mini-batch against its micro-batch, as the server line's verl splits them at every actor
    update, which no config check of verl sees (`validate_config` / `ActorConfig.validate` compare
    them only for the deprecated global `ppo_micro_batch_size`): the trainer hands each update
    `ppo_mini_batch_size * rollout.n` samples (`_update_actor`), the engine worker splits them
    over the data-parallel ranks (`train_mini_batch` asserts `mini_batch_size % dp == 0`) and the
    engine cuts each rank's share into micro-batches (`verl.workers.engine.utils.
    prepare_micro_batches` asserts it is a multiple of `ppo_micro_batch_size_per_gpu`), an
    AssertionError at the first update, after the first rollout. verl's modules holding those
    asserts import its whole engine stack (datasets, peft; tens of seconds), so the arithmetic is
    done here; tests/recipes/test_recipe_verl_checks.py holds it to verl's own
    `prepare_micro_batches`."""
    from verl.utils.config import omega_conf_to_dataclass

    section = config.actor_rollout_ref.actor
    micro = section.get("ppo_micro_batch_size_per_gpu")
    if section.get("use_dynamic_bsz") or not isinstance(micro, int) or micro < 1:
        return []  # dynamic batches are cut by tokens; a missing micro-batch is verl's own refusal
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actor = omega_conf_to_dataclass(section)
    n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    dp = _data_parallel_size(actor, n_gpus)
    mini = int(section.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n)
    if dp is None:
        return []
    named = (f"actor_rollout_ref.actor.ppo_mini_batch_size={section.ppo_mini_batch_size} x "
             f"actor_rollout_ref.rollout.n={config.actor_rollout_ref.rollout.n} = {mini} samples per actor update")
    if mini % dp:
        return [f"{named} over the actor's {dp} data-parallel ranks ({n_gpus} NPUs): verl's engine worker asserts "
                f"mini_batch_size % data_parallel_size == 0 at the first update (train_mini_batch)"]
    if (mini // dp) % micro:
        return [f"{named} = {mini // dp} per data-parallel rank ({dp} ranks), not a multiple of "
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}: verl's prepare_micro_batches "
                "asserts 'data size must be divisible by force_group_size * micro_batch_size_per_gpu' at the "
                "first actor update; make the per-rank mini-batch a multiple of the micro-batch"]
    return []


def check(cmd: Command, line: str) -> Tuple[List[str], List[str]]:
    """(problems, notes): verl's own checks on the composed job. Each problem says which of verl's
    steps refused and carries verl's message."""
    root = verl_dir()
    if root is None:
        return [], ["verl is not installed for this interpreter: verl's own config checks did not run"]
    problems: List[str] = []
    notes: List[str] = []
    try:
        config = compose(cmd, root)
    except Exception as exc:  # noqa: BLE001 - Hydra's override / config errors, each a refusal
        return [f"Hydra cannot compose verl's config from this command ({type(exc).__name__}): "
                f"{_message(exc)}"], notes
    from omegaconf import OmegaConf

    try:
        OmegaConf.resolve(config)
    except Exception as exc:  # noqa: BLE001 - InterpolationResolutionError and kin
        return [f"an interpolation in the composed config does not resolve ({type(exc).__name__}): "
                f"{_message(exc)}"], notes
    if cmd.experimental:
        if "async_training" not in config and cmd.entry.endswith("fully_async_main"):
            return ["the fully-async trainer needs an async_training section (its main raises "
                    "'must set async_training config')"], notes
        # what the experimental entry points' main does before its task runner (TODO in verl:
        # unify rollout config with actor_rollout_ref)
        config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes
        config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node
    ref, note = _reference_policy(config, line)
    if note:
        notes.append(note)
    critic, note = _critic(config)
    if note:
        notes.append(note)
    problems += typed_as_strings(cmd, root, config)
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    steps = [(VALIDATE,
              lambda: validate_config(config=config, use_reference_policy=ref, use_critic=critic))]
    if verl_lines.is_server_line(line) and not cmd.experimental:  # the async trainers batch otherwise
        steps.append((SPLIT, lambda: _raise(micro_batch_problems(config))))
    # the rollout and its checkpoint engine are built from their sections as they are (verl's
    # agent loop and trainer); the ref's section is renamed inside its worker before it is built
    for key in ("rollout", "rollout.checkpoint_engine"):
        node = OmegaConf.select(config.actor_rollout_ref, key)
        if node is not None and "_target_" in node:
            steps.append((f"omega_conf_to_dataclass(actor_rollout_ref.{key})",
                          lambda node=node: omega_conf_to_dataclass(node)))
    refused = set()
    for where, step in steps:
        if where == SPLIT and VALIDATE in refused:
            continue  # its batch sizes were refused already
        out = io.StringIO()
        try:
            # verl prints its "checks passed" banner and warns about its own defaults (profiler tool config)
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step()
        except Exception as exc:  # noqa: BLE001 - verl's AssertionError / ValueError / TypeError
            when = "at its first actor update" if where == SPLIT else "at launch"
            problems.append(f"verl refuses this job {when} ({where}): {_message(exc)}")
            refused.add(where)
    return problems, notes
