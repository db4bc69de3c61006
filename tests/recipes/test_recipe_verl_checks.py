"""verl's own validation in `npu-flashrl preflight launch` (npu_flashrl/recipes/verl_check.py): the
job's config composed by Hydra over the installed verl's own config tree with the recipe's
overrides, interpolations resolved by OmegaConf, then verl's `validate_config` and the rollout /
checkpoint-engine configs' `__post_init__` called on it, on the CPU.

The commands are the recipes' own: each recipe is run once with --dry-run (its verl checks off) and
its printed command is read back; the cases add one override each, as a user would. Stand-ins:
none for verl (its real code runs); the model directory holds an empty config.json and the data
files are empty (verl's checks read neither). Needs the installed verl to be the server-mode line
(the current line's venv); else it skips naming the line found.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.recipes import preflight as P
from npu_flashrl.recipes.command import read_command

EX = Path(__file__).resolve().parents[2] / "tests" / "verl_examples" / "configs"
RO = "actor_rollout_ref.rollout."
ACTOR = "actor_rollout_ref.actor."


def _installed_line():
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed for this interpreter")
    line = verl_lines.verl_line()
    if line != verl_lines.SERVER:
        pytest.skip(f"the installed verl runs the {line} config line; these cases are the server-mode line's")
    return line


def _recipe_env(tmp, model_config: str, **extra) -> dict:
    """A recipe's environment for a --dry-run in `tmp`: a model dir with `model_config` as its
    config.json, empty parquet files, an empty FlashRL config; none of the user's FlashRL / Ray
    settings nor the CPU harness's VLLM_PLUGINS / VLLM_ASCEND_ENABLE_NZ; `extra` on top."""
    model = tmp / "Qwen2.5-7B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(model_config)
    for name in ("train.parquet", "test.parquet"):
        (tmp / name).write_bytes(b"")
    cfg = tmp / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: int8_profile_free\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLASHRL_", "NPU_FLASHRL", "RAY_")) and k not in ("VLLM_PLUGINS", "VLLM_ASCEND_ENABLE_NZ")}
    env.update(HOME=str(tmp / "home"), MODEL_PATH=str(model), DATA_DIR=str(tmp), FLASHRL_CONFIG=str(cfg),
               PYTHON=sys.executable, **extra)
    return env


@pytest.fixture(scope="module")
def recipe_commands(tmp_path_factory):
    """The --dry-run commands of the colocated, one-step-off and fully-async int8 recipes."""
    _installed_line()
    env = _recipe_env(tmp_path_factory.mktemp("verl_checks"), "{}", NPU_FLASHRL_PREFLIGHT_VERL="0")
    out = {}
    for key, script in (("main", "test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh"),
                        ("one_step_off", "test_grpo_qwen25_7b_fsdp_int8_A2_one_step_off.sh"),
                        ("fully_async", "test_grpo_qwen25_7b_fsdp_int8_A2_fully_async.sh")):
        proc = subprocess.run(["bash", str(EX / script), "--dry-run"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[key] = proc.stdout
    return out, env


def launch(recipe_commands, which="main", *extra, features=("fsdp",)):
    text, env = recipe_commands
    cmd = read_command(text[which] + " " + " ".join(extra))
    prefix = ["env", *(f"{k}={v}" for k, v in cmd.env.items())] if cmd.env else []
    words = [*prefix, "python3", "-m", cmd.entry, *cmd.overrides]
    environ = dict(env, NPU_FLASHRL_PREFLIGHT_VERL="1")
    feats = list(features) + (["async"] if which != "main" else [])
    return P.launch_phase(words, environ, feats, verl_lines.SERVER, True, "8" if which != "main" else None, "hint")


@pytest.mark.parametrize("which", ["main", "one_step_off", "fully_async"])
def test_the_recipes_pass_verls_own_checks(recipe_commands, which):
    """Composed with the experimental trainers' own YAML (one-step-off names verl's tree relative
    to the working directory), the recipes' commands pass verl's validation as they are."""
    problems, notes = launch(recipe_commands, which)
    assert problems == [], problems
    assert not any("did not run" in n or "skipped" in n for n in notes), notes


CASES = {  # extra overrides: words the one problem must hold
    # FSDPActorConfig.__post_init__ (validate_config builds it)
    "loss_agg_mode": ([f"{ACTOR}loss_agg_mode=token-avg"],
                      ["validate_config", "Invalid loss_agg_mode: token-avg"]),
    # validate_config: data.train_batch_size x rollout.n against the NPUs without dynamic batching
    "batch_vs_npus": ([f"{ACTOR}use_dynamic_bsz=False", "data.train_batch_size=3", f"{RO}n=2",
                       f"{ACTOR}ppo_mini_batch_size=2"],
                      ["validate_config", "real_train_batch_size (6)", "minimal possible batch size (8)"]),
    # RolloutConfig.__post_init__ through omega_conf_to_dataclass
    "rollout_pipeline": ([f"{RO}pipeline_model_parallel_size=2"],
                         ["omega_conf_to_dataclass(actor_rollout_ref.rollout)", "pipeline_model_parallel_size > 1"]),
    # OmegaConf's interpolation, resolved as verl's task runner resolves it
    "interpolation_typo": ([f"{RO}log_prob_micro_batch_size_per_gpu=${{{ACTOR}ppo_micro_batch_size_per_gpux}}"],
                           ["interpolation", "ppo_micro_batch_size_per_gpux"]),
    # Hydra keeps 0x4 as text (YAML 1.1 would read 4)
    "hex_tp": ([f"{RO}tensor_model_parallel_size=0x4"],
               ["tensor_model_parallel_size=0x4", "string '0x4'", "int"]),
    "word_for_bool": ([f"{ACTOR}use_kl_loss=enabled"], ["use_kl_loss=enabled", "True or False"]),
    # the actor update's split (verl asserts it only at the first update): 8 x 4 samples over 8 ranks
    "micro_vs_mini": ([f"{ACTOR}use_dynamic_bsz=False", f"{ACTOR}ppo_micro_batch_size_per_gpu=3"],
                      ["mini-batch split", "= 4 per data-parallel rank (8 ranks)",
                       "ppo_micro_batch_size_per_gpu=3", "prepare_micro_batches"]),
    "mini_vs_dp": ([f"{ACTOR}use_dynamic_bsz=False", f"{ACTOR}ppo_mini_batch_size=1"],
                   ["mini-batch split", "= 4 samples per actor update", "8 data-parallel ranks"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_verl_refuses_at_launch_is_refused_before(recipe_commands, name):
    extra, needles = CASES[name]
    problems, _ = launch(recipe_commands, "main", *extra)
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], (needle, problems[0])


def test_a_valid_interpolation_is_accepted_not_blamed_on_a_variable(recipe_commands):
    """An interpolation to a key the command does not set is resolved by OmegaConf, not read as
    a bad number of the recipe variable behind the key."""
    problems, _ = launch(recipe_commands, "main", f"{RO}tensor_model_parallel_size=${{{RO}data_parallel_size}}")
    assert problems == [], problems


def test_the_fully_async_trainers_section_is_checked(recipe_commands):
    problems, _ = launch(recipe_commands, "fully_async", "async_training.staleness_threshold=abc")
    assert len(problems) == 1 and "async_training.staleness_threshold=abc" in problems[0], problems


def test_the_checks_can_be_skipped_only_with_a_note(recipe_commands):
    text, env = recipe_commands
    cmd = read_command(text["main"] + f" {ACTOR}loss_agg_mode=token-avg")
    words = ["python3", "-m", cmd.entry, *cmd.overrides]
    problems, notes = P.launch_phase(words, dict(env, NPU_FLASHRL_PREFLIGHT_VERL="0"), ["fsdp"],
                                     verl_lines.SERVER, True, None, "hint")
    assert problems == [] and any("NPU_FLASHRL_PREFLIGHT_VERL=0" in n for n in notes), notes
    problems, _ = P.launch_phase(words, dict(env, NPU_FLASHRL_PREFLIGHT_VERL="maybe"), ["fsdp"],
                                 verl_lines.SERVER, True, None, "hint")
    assert problems and "NPU_FLASHRL_PREFLIGHT_VERL" in problems[0], problems


@pytest.mark.every_line
def test_the_installed_lines_verl_refuses_through_the_recipe(tmp_path):
    """On every stack line: the recipe of the installed verl's line (51d2104: the pinned recipe;
    0.9.1: the _verl09 one) runs that verl's own validate_config in its dry run; a value verl
    refuses stops the recipe before anything is printed to launch, the same recipe without it passes."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed for this interpreter")
    line = verl_lines.verl_line()
    script = EX / ("test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh" if verl_lines.is_server_line(line)
                   else "test_grpo_qwen25_7b_fsdp_int8_A2.sh")
    env = _recipe_env(tmp_path, '{"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768}')
    bad = subprocess.run(["bash", str(script), "--dry-run", f"{ACTOR}loss_agg_mode=token-avg"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "verl refuses this job at launch (verl.utils.config.validate_config)" in bad.stderr, bad.stderr
    assert "Invalid loss_agg_mode: token-avg" in bad.stderr and "verl.trainer.main_ppo" not in bad.stdout
    good = subprocess.run(["bash", str(script), "--dry-run"], env=env, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stderr
    assert "verl.trainer.main_ppo" in good.stdout


def _verl_prepare_micro_batches():
    """verl 0.9.1's own `prepare_micro_batches` (verl/workers/engine/utils.py), loaded from its file
    without `verl.workers.engine`'s package __init__ (which imports every engine: peft, ...).
    Stand-in: where `datasets` is not installed (this CPU venv), the one name the module imports
    from `verl.utils.dataset.dataset_utils` (`DatasetPadMode`, unused by that function)."""
    import enum
    import types

    import verl

    try:
        import verl.utils.dataset.dataset_utils  # noqa: F401
    except ImportError:
        for name in [k for k in sys.modules if k.startswith("verl.utils.dataset")]:
            del sys.modules[name]
        stub = types.ModuleType("verl.utils.dataset.dataset_utils")
        stub.DatasetPadMode = enum.Enum("DatasetPadMode", {"NO_PADDING": "no_padding"})
        sys.modules["verl.utils.dataset.dataset_utils"] = stub
    path = os.path.join(os.path.dirname(verl.__file__), "workers", "engine", "utils.py")
    spec = importlib.util.spec_from_file_location("_verl_engine_utils_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prepare_micro_batches


def test_the_mini_batch_split_is_verls_own():
    """`verl_check.micro_batch_problems` refuses exactly the (mini-batch, micro-batch) pairs verl's
    own `prepare_micro_batches` asserts on, for each rank's share of an update (2 NPUs, n=2)."""
    import torch
    from verl.utils import tensordict_utils as tu

    from npu_flashrl.recipes import verl_check
    from npu_flashrl.recipes.command import Command

    _installed_line()
    prepare = _verl_prepare_micro_batches()
    root = verl_check.verl_dir()
    seen = set()
    for mini in (1, 2, 3, 4, 6):
        for micro in (1, 2, 3, 4):
            overrides = ["trainer.n_gpus_per_node=2", "trainer.nnodes=1", f"{RO}n=2", "data.train_batch_size=12",
                         f"{ACTOR}strategy=fsdp", f"{ACTOR}use_dynamic_bsz=False",
                         f"{ACTOR}ppo_mini_batch_size={mini}", f"{ACTOR}ppo_micro_batch_size_per_gpu={micro}"]
            config = verl_check.compose(Command("verl.trainer.main_ppo", {}, "ppo_trainer", overrides), root)
            ours = verl_check.micro_batch_problems(config)
            rows = mini * 2 // 2  # each of the 2 data-parallel ranks' share of mini x n samples
            data = tu.get_tensordict({"x": torch.zeros(rows, 1)},
                                     non_tensor_dict={"use_dynamic_bsz": False, "micro_batch_size_per_gpu": micro})
            try:
                prepare(data)
                refused = False
            except AssertionError:
                refused = True
            assert bool(ours) == refused, (mini, micro, ours)
            seen.add(refused)
    assert seen == {True, False}
