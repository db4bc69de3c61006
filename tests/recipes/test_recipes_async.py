"""The scale-out recipes (tests/verl_examples/configs/test_grpo_qwen25_7b_fsdp_{int8,bf16}_A2_
{one_step_off,fully_async}.sh, docs/scale_out.md): dry runs through verl 0.9.1's experimental
trainers with a separate rollout pool and checkpoint_engine.backend=nccl (HCCL on Ascend), every
override linted against verl 0.9.1's experimental config (ppo_trainer + the trainer's own YAML),
the bf16 twins differing only in the rollout's precision, the preflight refusals. Only yaml is
read, no verl is imported."""
from __future__ import annotations

import os
import subprocess

import pytest

from test_recipes import (EX, inputs, lint_overrides, overrides_of, parse_command, run,  # noqa: F401
                                 schema_dir_091, verl_command)

CFG = EX / "configs"
INT8_OSO = CFG / "test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh"
RECIPES = {("int8", "one_step_off"): INT8_OSO,
           ("bf16", "one_step_off"): CFG / "test_grpo_qwen25_7b_fsdp_bf16_A2_one_step_off.sh",
           ("int8", "fully_async"): CFG / "test_grpo_qwen25_7b_fsdp_int8_A2_fully_async.sh",
           ("bf16", "fully_async"): CFG / "test_grpo_qwen25_7b_fsdp_bf16_A2_fully_async.sh"}
ENTRY = {"one_step_off": "verl.experimental.one_step_off_policy.main_ppo",
         "fully_async": "verl.experimental.fully_async_policy.fully_async_main"}


@pytest.fixture()
def env(inputs, tmp_path):  # noqa: F811
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: int8_profile_free\n    wire: int8\n")
    return dict(inputs["env"], FLASHRL_CONFIG=str(cfg))


def _overrides(stdout, entry):
    words = verl_command(stdout)
    assert entry in words, words[:20]
    rest = words[words.index(entry) + 1:]
    return dict(w.split("=", 1) for w in rest if "=" in w and not w.startswith("--"))


@pytest.mark.parametrize("key", list(RECIPES), ids=lambda k: "-".join(k))
def test_dry_run_lints_against_verl_091_experimental_config(env, key):
    precision, mode = key
    proc = run(RECIPES[key], bf16_config(env) if precision == "bf16" else env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    ov = _overrides(proc.stdout, ENTRY[mode])
    assert ov["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    assert ov["rollout.n_gpus_per_node"] == "4" and ov["trainer.n_gpus_per_node"] == "4"
    assert ov["trainer.experiment_name"] == f"qwen25_7b_fsdp_{mode}_{precision}_A2_verl09"
    assert ("async_training.partial_rollout" in ov) == (mode == "fully_async")
    config_name, overrides = parse_command(proc.stdout[proc.stdout.index("env \\"):])
    schema = lint_overrides.load_schema(config_name, schema_dir_091(), ENTRY[mode])
    assert lint_overrides.lint(overrides, schema) == []
    # the experimental keys are not in verl's plain ppo_trainer schema: the lint would catch them
    plain = lint_overrides.load_schema(config_name, schema_dir_091())
    assert any("rollout.n_gpus_per_node" in p for p in lint_overrides.lint(overrides, plain))


def bf16_config(env):
    """The bf16 twin's own FlashRL config (the preflight refuses it an INT8 one: an INT8 rollout
    under the bf16 name)."""
    cfg = os.path.join(os.path.dirname(env["FLASHRL_CONFIG"]), "bf16.yaml")
    with open(cfg, "w") as f:
        f.write("configs:\n  - fn: bf16\n")
    return dict(env, FLASHRL_CONFIG=cfg)


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_bf16_twin_differs_only_in_precision(env, mode):
    a = _overrides(run(RECIPES[("int8", mode)], env, "--dry-run").stdout, ENTRY[mode])
    b = _overrides(run(RECIPES[("bf16", mode)], bf16_config(env), "--dry-run").stdout, ENTRY[mode])
    diff = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert diff == {"trainer.experiment_name", "trainer.default_local_dir",
                    "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"}, diff
    refused = run(RECIPES[("bf16", mode)], env, "--dry-run")  # the INT8 config under the bf16 name
    assert refused.returncode == 1 and "ROLLOUT_PRECISION=bf16 but FLASHRL_CONFIG" in refused.stderr


@pytest.mark.parametrize("extra_env, args, needle", [
    ({"CHECKPOINT_ENGINE": "delta_sharded"}, (), "CHECKPOINT_ENGINE=delta_sharded"),
    ({"CHECKPOINT_ENGINE": "hccl"}, (), "CHECKPOINT_ENGINE must be one of naive, nccl"),
    ({}, ("actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded",), "delta_sharded"),
    ({"TRAINER_NPUS": "6"}, (), "exceed NPUS_PER_NODE=8"),
    ({"ROLLOUT_TP": "8"}, (), "ROLLOUT_TP=8 (actor_rollout_ref.rollout.tensor_model_parallel_size) must divide ROLLOUT_NPUS=4"),
    ({"ASYNC_MODE": "both"}, (), "ASYNC_MODE must be one of one_step_off, fully_async"),
    ({"ROLLOUT_NPUS": "4x"}, (), "ROLLOUT_NPUS must be an integer"),
    ({"STALENESS": "abc", "ASYNC_MODE": "fully_async"}, (), "STALENESS must be a finite number"),
    ({"NPUS_PER_NODE": " 8"}, (), "NPUS_PER_NODE must be an integer"),
    ({}, ("actor_rollout_ref.rollout.quantization=fp8",), "drop actor_rollout_ref.rollout.quantization"),
    ({}, ("--dryrun",), "unknown option"),
])
def test_preflight_refusals(env, extra_env, args, needle):
    proc = run(INT8_OSO, dict(env, **extra_env), *(args if "--dryrun" in args else ("--dry-run", *args)))
    assert proc.returncode in (1, 2), proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert ENTRY["one_step_off"] not in proc.stdout


@pytest.mark.parametrize("name", ["STALENESS", "TRIGGER_SYNC_STEPS", "TOTAL_ROLLOUT_STEPS"])
def test_fully_async_variables_are_noted_on_a_one_step_off_run(env, name):
    """A one-step-off run does not read the fully-async trainer's variables: said, not ignored."""
    proc = run(INT8_OSO, dict(env, **{name: "3"}), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"{name}='3' is set but this recipe does not read it (used by the fully_async recipes)" in proc.stderr


@pytest.mark.parametrize("layout", [
    # docs/scale_out.md section 7: a trainer node and rollout nodes of 8 NPUs, on a Ray cluster
    {"TRAINER_NPUS": "8", "ROLLOUT_NPUS": "8", "ROLLOUT_NNODES": "2", "RAY_ADDRESS": "10.0.0.1:6379"},
    # the rollout replicas (TP 4) on the rollout pool, whatever the trainer pool's size
    {"TRAINER_NPUS": "2", "ROLLOUT_NPUS": "4", "ROLLOUT_TP": "4"},
], ids=["two-node-pools", "small-trainer-pool"])
def test_valid_layouts_are_accepted(env, layout):
    proc = run(INT8_OSO, dict(env, **layout), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    ov = _overrides(proc.stdout, ENTRY["one_step_off"])
    assert ov["trainer.n_gpus_per_node"] == layout["TRAINER_NPUS"]
    assert ov["rollout.n_gpus_per_node"] == layout["ROLLOUT_NPUS"]
    assert ov["rollout.nnodes"] == layout.get("ROLLOUT_NNODES", "1")


@pytest.mark.parametrize("key", [("int8", "fully_async"), ("bf16", "one_step_off")], ids="-".join)
def test_a_twins_messages_carry_its_own_name(env, key):
    """A twin hands over to the int8 one-step-off script with exec; its messages keep the name
    of the recipe the user ran."""
    proc = run(RECIPES[key], dict(env, ROLLOUT_TP="8"), "--dry-run")
    name = RECIPES[key].stem
    assert proc.returncode == 1 and f"[{name}] ERROR: ROLLOUT_TP=8" in proc.stderr, proc.stderr
    assert "[test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off]" not in proc.stderr


def test_help_is_its_own():
    proc = subprocess.run(["bash", str(RECIPES[("bf16", "fully_async")]), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "fully_async twin" in proc.stdout


@pytest.mark.parametrize("key", list(RECIPES), ids=lambda k: "-".join(k))
def test_entry_scripts_prepare_the_config_and_run_their_launch(inputs, key):  # noqa: F811
    """flash_rl/ has an entry for every scale-out launch: `npu-flashrl setup` when the config is
    missing, then the launch through the experimental trainer with that config."""
    precision, mode = key
    entry = EX / "flash_rl" / f"grpo_qwen25_7b_fsdp_{precision}_A2_{mode}.sh"
    # the bf16 entries fix FLASHRL_FN=bf16 (and refuse another value the user set: test_recipes.py)
    fn_env = {} if precision == "bf16" else {"FLASHRL_FN": "int8_profile_free"}
    proc = run(entry, dict(inputs["env"], SETUP_EXTRA="wire=int8", **fn_env), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    fn = "bf16" if precision == "bf16" else "int8_profile_free"
    config = inputs["tmp"] / "run" / "configs" / f"Qwen2.5-7B-Instruct.{fn}.yaml"
    assert f"npu-flashrl setup -m {inputs['model']} --fn {fn} -o {config} wire=int8" in \
        proc.stdout.replace(" \\\n    ", " ")
    ov = _overrides(proc.stdout, ENTRY[mode])
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"] == f"'{config}'"
    assert ov["trainer.experiment_name"] == f"qwen25_7b_fsdp_{mode}_{precision}_A2_verl09"


def test_readme_lists_every_recipe():
    readme = (EX / "README.md").read_text()
    for script in sorted((EX / "flash_rl").glob("*.sh")) + sorted((EX / "configs").glob("*.sh")):
        assert f"`{script.name}`" in readme, script.name
    for config in sorted((EX / "configs").glob("*.sh")):  # every launch has an entry script
        assert (EX / "flash_rl" / config.name.replace("test_grpo_", "grpo_")).exists(), config.name
