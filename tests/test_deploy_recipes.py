"""verl recipes of tests/verl_examples: --dry-run commands, env overrides, preflight errors, Hydra lint.

The lint checks every override against the config schema of the installed verl (0.6.1 in the CPU
stack, same keys as the pinned commit 51d2104); set NPU_FLASHRL_VERL_SRC to a verl source tree to
lint against that instead.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "tests" / "verl_examples"
FSDP_INT8 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_int8_A2.sh"
FSDP_BF16 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_bf16_A2.sh"
MEGATRON_INT8 = EX / "flash_rl" / "grpo_qwen25_7b_megatron_int8_A2.sh"
FSDP_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2.sh"
MEGATRON_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_megatron_int8_A2.sh"
ENTRIES = [FSDP_INT8, FSDP_BF16, MEGATRON_INT8]

spec = importlib.util.spec_from_file_location("lint_overrides", EX / "lint_overrides.py")
lint_overrides = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint_overrides)


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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "NPU_FLASHRL", "RAY_"))}
    env.update(HOME=str(tmp_path / "home"), MODEL_PATH=str(model), DATA_DIR=str(data),
               RUN_DIR=str(tmp_path / "run"))
    return {"tmp": tmp_path, "model": model, "quant": quant, "data": data, "env": env}


def run(script, env, *args):
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
        # not the published recipe's True/True: that does no TIS at verl 51d2104 (test_verl_51d2104_tis.py)
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
    (run_dir / "configs" / "Qwen2.5-7B-Instruct.int8.yaml").write_text("configs: []\n")
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


def test_bf16_baseline_without_npu_flashrl(inputs):
    proc = run(FSDP_BF16, dict(inputs["env"], BASELINE_NPU_FLASHRL="0"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "FLASHRL_CONFIG" not in proc.stdout and "npu-flashrl" not in proc.stdout


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
    assert proc.returncode != 0 and "exceeds" in proc.stderr


# ------------------------------------------------------------------------------------------- preflight
@pytest.mark.parametrize("script", ENTRIES + [FSDP_CONFIG, MEGATRON_CONFIG], ids=lambda p: p.name)
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "real"])
def test_missing_model_path_is_named(inputs, script, dry):
    missing = str(inputs["tmp"] / "no" / "such-model")
    proc = run(script, dict(inputs["env"], MODEL_PATH=missing), *(["--dry-run"] if dry else []))
    assert proc.returncode != 0
    assert "MODEL_PATH" in proc.stderr and missing in proc.stderr, proc.stderr
    assert "npu-flashrl" not in proc.stdout and "main_ppo" not in proc.stdout


@pytest.mark.parametrize("script", ENTRIES, ids=lambda p: p.name)
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


# ------------------------------------------------------------------------------------------- Hydra lint
def verl_dir():
    src = os.environ.get("NPU_FLASHRL_VERL_SRC")
    if src:
        return src
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (the CPU stack installs verl 0.6.1); set NPU_FLASHRL_VERL_SRC")
    return None


@pytest.mark.parametrize("script", ENTRIES, ids=lambda p: p.name)
def test_every_override_exists_in_verl_schema(inputs, script):
    vd = verl_dir()
    proc = run(script, inputs["env"], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    config_name, overrides = lint_overrides.parse_command(proc.stdout[proc.stdout.index("env \\"):])
    assert len(overrides) > 50
    problems = lint_overrides.lint(overrides, lint_overrides.load_schema(config_name, vd))
    assert problems == []


def test_lint_catches_misspelled_and_misused_keys():
    vd = verl_dir()
    schema = lint_overrides.load_schema("ppo_trainer", vd)
    bad = [
        "actor_rollout_ref.rollout.calculate_log_prob=True",          # misspelled (missing 's')
        "algorithm.rollout_correction.rollout_is_treshold=2.0",       # misspelled
        "+actor_rollout_ref.rollout.mode=sync",                        # '+' on an existing key
        "actor_rollout_ref.rollout.mode=async",                        # refused value
        "algorithm.rollout_correction.rollout_is=tokens",              # refused value
    ]
    problems = lint_overrides.lint(bad, schema)
    assert len(problems) == len(bad), problems
    assert lint_overrides.lint(["actor_rollout_ref.rollout.calculate_log_probs=True"], schema) == []
