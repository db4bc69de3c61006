"""Lint the Hydra overrides of a verl launch command against verl's own config schema.

Reads a command (e.g. a recipe's ``--dry-run`` output, backslash continuations allowed) and checks
every override after ``verl.trainer.main_ppo`` against the flattened reference config that verl ships
(``verl/trainer/config/_generated_ppo_trainer.yaml`` or ``_generated_ppo_megatron_trainer.yaml`` for
``--config-name=ppo_megatron_trainer``). Lint each recipe against the verl of its line: the pinned
recipes against 51d2104 (verl 0.6.1 has the same keys, only ``*.megatron.dist_checkpointing_prefix``
is missing there), the ``*_verl09`` recipes against verl 0.9.1. Which line a schema is, is read from
it: verl 0.7+ has ``algorithm.rollout_correction.loss_type`` (which replaced ``use_policy_gradient``).

Rules:
  * ``key=value``: ``key`` must exist in the schema (a misspelled key is an error);
  * ``+key=value``: ``key`` must NOT exist (Hydra refuses to add an existing key) and its nearest
    existing ancestor must be a mapping (e.g. ``override_transformer_config``, ``ray_kwargs.ray_init``);
  * a few values are checked, per line: rollout mode (51d2104: ``sync``, which npu_flashrl needs
    there; 0.7+: not ``sync``, which verl removed), TIS level, calculate_log_probs,
    use_policy_gradient (51d2104), the sync bucket size (0.7+: a positive integer);
  * ``actor_rollout_ref.rollout.quantization`` next to a ``FLASHRL_CONFIG`` in the Ray runtime env is
    refused (verl would quantize the rollout itself).

Usage: bash recipe.sh --dry-run 2>/dev/null | python lint_overrides.py [--verl-dir DIR]
Exit status 0 when clean, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from typing import Dict, List, Optional, Tuple

import yaml

ENTRY_MODULE = "verl.trainer.main_ppo"
# verl 0.9's experimental trainers (docs/scale_out.md): their Hydra config is ppo_trainer plus the
# keys of their own YAML (rollout.*, async_training.*), merged into the schema here.
EXPERIMENTAL_ENTRIES = {
    "verl.experimental.one_step_off_policy.main_ppo":
        ("experimental", "one_step_off_policy", "config", "one_step_off_ppo_trainer.yaml"),
    "verl.experimental.fully_async_policy.fully_async_main":
        ("experimental", "fully_async_policy", "config", "fully_async_ppo_trainer.yaml"),
}
COMMON_RULES = {
    "algorithm.rollout_correction.rollout_is": {"null", "token", "sequence"},
    "actor_rollout_ref.rollout.calculate_log_probs": {"True", "true"},
}
VALUE_RULES = {  # per line: a set of allowed values, or a predicate
    "51d2104": dict(COMMON_RULES, **{
        "actor_rollout_ref.rollout.mode": {"sync"},
        # True never reaches the Ray workers at verl 51d2104 (npu_flashrl.adapters.verl.check_tis)
        "algorithm.rollout_correction.use_policy_gradient": {"False", "false"},
    }),
    "0.7+": dict(COMMON_RULES, **{
        # RolloutConfig.__post_init__ raises on sync from verl 0.7.0 on
        "actor_rollout_ref.rollout.mode": {"async"},
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
            lambda v: v.isdigit() and int(v) > 0,
    }),
}
FLASHRL_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"
QUANT_KEYS = ("actor_rollout_ref.rollout.quantization",
              "actor_rollout_ref.rollout.engine_kwargs.vllm.quantization")


def schema_line(schema: Dict[str, object]) -> str:
    """'0.7+' (server mode, verl 0.7 .. 0.9.x) or '51d2104' (and 0.6.x): read from the schema."""
    return "0.7+" if "algorithm.rollout_correction.loss_type" in schema else "51d2104"


def find_verl_config_dir(verl_dir: Optional[str] = None) -> str:
    if verl_dir:
        cand = os.path.join(verl_dir, "verl", "trainer", "config")
        if not os.path.isdir(cand):
            cand = os.path.join(verl_dir, "trainer", "config")
        return cand
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("verl is not installed and --verl-dir not given (the verl source tree or "
                                "package of the recipe's line: 51d2104 for the pinned recipes, 0.9.1 "
                                "for the *_verl09 ones)")
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
    with open(path, encoding="utf-8") as fh:
        schema = flatten(yaml.safe_load(fh))
    if entry in EXPERIMENTAL_ENTRIES:
        verl_pkg = os.path.dirname(os.path.dirname(config_dir))  # .../verl/trainer/config -> .../verl
        with open(os.path.join(verl_pkg, *EXPERIMENTAL_ENTRIES[entry]), encoding="utf-8") as fh:
            own = yaml.safe_load(fh)
        for key, value in flatten({k: v for k, v in own.items() if k not in ("hydra", "defaults")}).items():
            if key:
                schema.setdefault(key, value)
    return schema


def entry_of(words: List[str]) -> str:
    for entry in (ENTRY_MODULE, *EXPERIMENTAL_ENTRIES):
        if entry in words:
            return entry
    raise ValueError(f"no '{ENTRY_MODULE}' (or one of {', '.join(EXPERIMENTAL_ENTRIES)}) in the command")


def parse_command(text: str) -> Tuple[str, List[str]]:
    """(config name, overrides) from a shell command text."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    rest = words[words.index(entry_of(words)) + 1:]
    config_name = "ppo_trainer"
    overrides = []
    for w in rest:
        if w.startswith("--config-name="):
            config_name = w.split("=", 1)[1]
        elif w.startswith("--"):
            continue
        elif "=" in w:
            overrides.append(w)
    return config_name, overrides


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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verl-dir", help="verl source tree or package dir (default: the installed verl)")
    ap.add_argument("file", nargs="?", help="command text (default: stdin)")
    args = ap.parse_args(argv)
    text = open(args.file).read() if args.file else sys.stdin.read()
    config_name, overrides = parse_command(text)
    entry = entry_of(shlex.split(text.replace("\\\n", " "), comments=True))
    schema = load_schema(config_name, args.verl_dir, entry)
    problems = lint(overrides, schema)
    for p in problems:
        print(p)
    if not problems:
        print(f"ok: {len(overrides)} overrides match verl's {config_name} schema ({schema_line(schema)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
