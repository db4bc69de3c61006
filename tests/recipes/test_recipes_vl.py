"""The Qwen2.5-VL-7B recipe pair (tests/verl_examples/flash_rl/grpo_qwen25_vl_7b_fsdp_{int8,bf16}_A2_verl09.sh)
and its data preparation (DATASET=geo3k), through their --dry-run output: verl's own VL GRPO
example's settings (image column, lengths, Geometry3K parquet), the current line's server-mode
launch, and a bf16 twin that differs only in the rollout quantization. Nothing is launched; the
model dir and parquet files are empty stand-ins, `npu-flashrl preflight` runs for real."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

EX = Path(__file__).resolve().parents[1] / "verl_examples"
INT8 = EX / "flash_rl" / "grpo_qwen25_vl_7b_fsdp_int8_A2_verl09.sh"
BF16 = EX / "flash_rl" / "grpo_qwen25_vl_7b_fsdp_bf16_A2_verl09.sh"


@pytest.fixture()
def env(tmp_path):
    model = tmp_path / "models" / "Qwen2.5-VL-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    data = tmp_path / "data" / "geo3k"
    data.mkdir(parents=True)
    for f in ("train.parquet", "test.parquet"):
        (data / f).write_bytes(b"")
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLASHRL_", "NPU_FLASHRL", "RAY_")) and k not in ("VLLM_PLUGINS", "VLLM_ASCEND_ENABLE_NZ")}
    out.update(HOME=str(tmp_path / "home"), MODEL_PATH=str(model), DATA_DIR=str(data),
               RUN_DIR=str(tmp_path / "run"), PYTHON=sys.executable)
    return out


def run(script, env, *args):
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=120)


def overrides(stdout):
    text = stdout[stdout.index("env \\"):]
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    rest = words[words.index("verl.trainer.main_ppo") + 1:]
    return dict(w.split("=", 1) for w in rest if "=" in w and not w.startswith("--"))


def test_vl_int8_recipe_runs_verls_vl_settings_on_the_current_line(env):
    proc = run(INT8, env, "--dry-run", "trainer.total_epochs=1")
    assert proc.returncode == 0, proc.stderr
    ov = overrides(proc.stdout)
    assert ov["data.image_key"] == "images"
    assert ov["data.max_prompt_length"] == "1024" and ov["data.max_response_length"] == "2048"
    assert ov["actor_rollout_ref.model.path"] == env["MODEL_PATH"]
    assert ov["data.train_files"] == os.path.join(env["DATA_DIR"], "train.parquet")
    assert not any(k.endswith("rollout.mode") for k in ov)  # server mode
    assert ov["trainer.total_epochs"] == "1"
    assert ov["trainer.experiment_name"] == "qwen25_vl_7b_fsdp_int8_profile_free_A2_verl09"
    assert "--fn int8_profile_free" in proc.stdout and "npu-flashrl profile" not in proc.stdout
    assert ov["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"].strip("'").endswith(
        "Qwen2.5-VL-7B-Instruct.int8_profile_free.yaml")


def test_vl_bf16_twin_differs_only_in_quantization(env):
    a, b = run(INT8, dict(env, EXPERIMENT_NAME="x"), "--dry-run"), run(BF16, dict(env, EXPERIMENT_NAME="x"), "--dry-run")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    oa, ob = overrides(a.stdout), overrides(b.stdout)
    diff = {k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k)}
    assert diff == {"+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"}, diff
    assert "--fn bf16" in b.stdout and ob["data.image_key"] == "images"
    assert run(BF16, env, "--dry-run").stdout.count("qwen25_vl_7b_fsdp_bf16_A2_verl09") >= 1


def test_vl_recipe_refuses_a_missing_dataset(env, tmp_path):
    proc = run(INT8, dict(env, DATA_DIR=str(tmp_path / "nope")), "--dry-run")
    assert proc.returncode != 0 and "TRAIN_FILE" in proc.stderr


def test_geo3k_data_prep_dry_run(tmp_path):
    verl = tmp_path / "verl"
    (verl / "examples" / "data_preprocess").mkdir(parents=True)
    (verl / "examples" / "data_preprocess" / "geo3k.py").write_text("")
    local = tmp_path / "geometry3k"
    local.mkdir()
    env = dict(os.environ, VERL_DIR=str(verl), DATA_ROOT=str(tmp_path / "data"), DATASET="geo3k",
               GEO3K_LOCAL_PATH=str(local))
    proc = run(EX / "data" / "prepare_data.sh", env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"geo3k.py --local_dir {tmp_path / 'data' / 'geo3k'} --local_dataset_path {local}" in proc.stdout
    assert not (tmp_path / "data").exists()
    (verl / "examples" / "data_preprocess" / "geo3k.py").unlink()
    proc = run(EX / "data" / "prepare_data.sh", env, "--dry-run")
    assert proc.returncode != 0 and "geo3k.py" in proc.stderr
