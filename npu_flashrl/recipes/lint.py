"""Lint the Hydra overrides of a verl launch command against verl's own config schema: the
flattened reference config verl ships (``verl/trainer/config/_generated_ppo_trainer.yaml``, or
``_generated_ppo_megatron_trainer.yaml`` for ``--config-name=ppo_megatron_trainer``; an
experimental trainer's own YAML merged over it). Which config line a schema is, is read from it:
the server-mode line has ``algorithm.rollout_correction.loss_type`` (which replaced
``use_policy_gradient``).

Rules:
  * ``key=value``: ``key`` must exist in the schema (a misspelled key is an error);
  * ``+key=value``: ``key`` must NOT exist (Hydra refuses to add an existing key) and its nearest
    existing ancestor must be a mapping (e.g. ``override_transformer_config``, ``ray_kwargs.ray_init``);
  * a few values are checked, per line: rollout mode (sync line: ``sync``, which npu_flashrl needs
    there; server line: not ``sync``), TIS level, calculate_log_probs, use_policy_gradient (sync
    line), the sync bucket size (server line: a positive integer);
  * ``actor_rollout_ref.rollout.quantization`` next to a ``FLASHRL_CONFIG`` in the Ray runtime env is
    refused (verl would quantize the rollout itself).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Dict, List, Optional

import yaml

from npu_flashrl.lines import verl as verl_lines

# libyaml's loader when PyYAML has it: verl's reference config is large and this runs on every dry run
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

ENTRY_MODULE = verl_lines.ENTRY_MAIN
# the experimental trainers' Hydra config is ppo_trainer plus the keys of their own YAML
# (rollout.*, async_training.*), merged into the schema here
EXPERIMENTAL_ENTRIES = verl_lines.ENTRY_EXPERIMENTAL
COMMON_RULES = {
    "algorithm.rollout_correction.rollout_is": {"null", "token", "sequence"},
    "actor_rollout_ref.rollout.calculate_log_probs": {"True", "true"},
}
VALUE_RULES = {  # per line: a set of allowed values, or a predicate
    verl_lines.SYNC: dict(COMMON_RULES, **{
        "actor_rollout_ref.rollout.mode": {"sync"},
        # True never reaches the Ray workers on the sync line (lines.verl, its tis_problems)
        "algorithm.rollout_correction.use_policy_gradient": {"False", "false"},
    }),
    verl_lines.SERVER: dict(COMMON_RULES, **{
        # RolloutConfig.__post_init__ raises on sync on the server line
        "actor_rollout_ref.rollout.mode": {"async"},
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
            lambda v: v.isdigit() and int(v) > 0,
    }),
}
FLASHRL_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"
QUANT_KEYS = ("actor_rollout_ref.rollout.quantization",
              "actor_rollout_ref.rollout.engine_kwargs.vllm.quantization")


def schema_line(schema: Dict[str, object]) -> str:
    """The verl config line (`lines.verl.SERVER` or `SYNC`) of a schema, read from it."""
    return verl_lines.SERVER if "algorithm.rollout_correction.loss_type" in schema else verl_lines.SYNC


def find_verl_config_dir(verl_dir: Optional[str] = None) -> str:
    if verl_dir:
        if not os.path.isdir(verl_dir):
            raise FileNotFoundError(f"--verl-dir {verl_dir}: no such directory (expected a verl source tree "
                                    f"or the installed verl package dir)")
        for cand in (os.path.join(verl_dir, "verl", "trainer", "config"),
                     os.path.join(verl_dir, "trainer", "config")):
            if os.path.isdir(cand):
                return cand
        raise FileNotFoundError(f"--verl-dir {verl_dir}: neither verl/trainer/config nor trainer/config in it "
                                f"(expected a verl source tree or the installed verl package dir)")
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("verl is not installed and --verl-dir not given (the verl source tree or "
                                "package of the recipe's line: "
                                + ", ".join(f"{r} for the {n} recipes" for n, r in (
                                    ("pinned", verl_lines.RELEASES[verl_lines.SYNC]),
                                    ("*_verl09", verl_lines.RELEASES[verl_lines.SERVER]))) + ")")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


def flatten(node, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    if isinstance(node, dict):
        out[prefix] = node  # mappings are addressable too (for '+' parents)
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = node
    return out


def load_schema(config_name: str, verl_dir: Optional[str] = None,
                entry: str = ENTRY_MODULE) -> Dict[str, object]:
    config_dir = find_verl_config_dir(verl_dir)
    path = os.path.join(config_dir, f"_generated_{config_name}.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file: this verl has no generated schema for config "
                                f"'{config_name}' (a verl release older than the recipe's line?)")
    with open(path, encoding="utf-8") as fh:
        schema = flatten(yaml.load(fh, Loader=_Loader))
    if entry in EXPERIMENTAL_ENTRIES:
        verl_pkg = os.path.dirname(os.path.dirname(config_dir))  # .../verl/trainer/config -> .../verl
        with open(os.path.join(verl_pkg, *EXPERIMENTAL_ENTRIES[entry]), encoding="utf-8") as fh:
            own = yaml.load(fh, Loader=_Loader)
        for key, value in flatten({k: v for k, v in own.items() if k not in ("hydra", "defaults")}).items():
            if key:
                schema.setdefault(key, value)
    return schema


def lint(overrides: List[str], schema: Dict[str, object]) -> List[str]:
    problems = []
    rules = VALUE_RULES[schema_line(schema)]
    if any(ov.split("=", 1)[0] == FLASHRL_ENV for ov in overrides):
        for ov in overrides:
            key, value = ov.split("=", 1)
            if key.lstrip("+") in QUANT_KEYS and value.strip("'\"").lower() not in ("null", "none", "~", ""):
                problems.append(f"{ov}: verl's own rollout quantization next to FLASHRL_CONFIG; drop "
                                f"'{key.lstrip('+')}' for npu_flashrl's INT8 rollout")
    for ov in overrides:
        key, value = ov.split("=", 1)
        if key.startswith("~"):
            key = key[1:]
            if key not in schema:
                problems.append(f"{ov}: cannot delete '{key}', it is not in verl's config")
            continue
        if key.startswith("++"):
            continue  # force-add/override: accepted either way
        if key.startswith("+"):
            key = key[1:]
            if key in schema:
                problems.append(f"{ov}: '{key}' already exists in verl's config, drop the '+'")
                continue
            parent = key
            while "." in parent:
                parent = parent.rsplit(".", 1)[0]
                if parent in schema:
                    if not isinstance(schema[parent], dict):
                        problems.append(f"{ov}: cannot add under '{parent}', it is not a mapping")
                    break
            continue
        if key not in schema:
            near = sorted(k for k in schema if k.rsplit(".", 1)[0] == key.rsplit(".", 1)[0])[:8]
            problems.append(f"{ov}: unknown key '{key}' in verl's config" + (f" (siblings: {', '.join(near)})" if near else ""))
            continue
        allowed = rules.get(key)
        if callable(allowed):
            if not allowed(value):
                problems.append(f"{ov}: value '{value}' is not a positive integer")
        elif allowed is not None and value not in allowed:
            problems.append(f"{ov}: value '{value}' not in {sorted(allowed)}")
    return problems
