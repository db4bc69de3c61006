"""The W4A8 recipe (tests/verl_examples/flash_rl/grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh and its
launch configs/test_grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh) and its bf16 twin: the dry run writes a
`--fn w4a8_profile_free` config with `npu-flashrl setup` (no profile, no W8A8 checkpoint), runs
under ROLLOUT_PRECISION=w4a8, differs from the bf16 twin only in the rollout's config (and the
bucket size the test sets), passes verl 0.9.1's own checks, and the preflight holds FLASHRL_CONFIG
to the precision (a W4A8 run with an INT8 config, or an INT8 run with a W4A8 one, is refused).
The recipes run for real (bash, `npu-flashrl preflight`); the model dir holds an empty config.json
and the data files are empty (a dry run reads neither)."""
from __future__ import annotations

import importlib.util
import subprocess

import pytest

from test_recipes import (BUCKET_KEY, EX, MEG32_BF16, V09_BF16, V09_CONFIG, inputs,  # noqa: F401
                          overrides_of, run)

W4A8 = EX / "flash_rl" / "grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh"
W4A8_CONFIG = EX / "configs" / "test_grpo_qwen25_7b_fsdp_w4a8_A2_verl09.sh"
MEG32_W4A8 = EX / "flash_rl" / "grpo_qwen25_32b_megatron_w4a8_A2_verl09.sh"
FLASHRL_KEY = "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"


def test_w4a8_dry_run_sets_up_a_w4a8_config_and_launches_as_w4a8(inputs):  # noqa: F811
    """group_size=128 by default (SETUP_EXTRA): Qwen2.5-7B's row-parallel in-dims per rank at the
    recipe's rollout TP 4 are not multiples of vllm-ascend's default 256."""
    proc = run(W4A8, dict(inputs["env"], QUANT_MODEL_PATH=str(inputs["tmp"] / "absent")), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    config = inputs["tmp"] / "run" / "configs" / "Qwen2.5-7B-Instruct.w4a8_profile_free.yaml"
    assert (f"npu-flashrl setup -m {inputs['model']} --fn w4a8_profile_free -o {config} group_size=128"
            in proc.stdout.replace(" \\\n    ", " "))
    assert "npu-flashrl profile" not in proc.stdout
    ov = overrides_of(proc.stdout)
    assert ov[FLASHRL_KEY] == str(config)
    assert ov["trainer.experiment_name"] == "qwen25_7b_fsdp_w4a8_A2_verl09"
    assert "ROLLOUT_PRECISION=w4a8" in proc.stderr
    mine = run(W4A8, dict(inputs["env"], SETUP_EXTRA="group_size=64"), "--dry-run")
    assert mine.returncode == 0 and " group_size=64" in mine.stdout and "group_size=128" not in mine.stdout


@pytest.mark.parametrize("w4a8, bf16", [(W4A8, V09_BF16), (MEG32_W4A8, MEG32_BF16)],
                         ids=["qwen25_7b_fsdp", "qwen25_32b_megatron"])
def test_w4a8_and_its_bf16_twin_differ_only_in_quantization(inputs, w4a8, bf16):  # noqa: F811
    a = run(w4a8, dict(inputs["env"], EXPERIMENT_NAME="x"), "--dry-run")
    b = run(bf16, dict(inputs["env"], EXPERIMENT_NAME="x", UPDATE_WEIGHTS_BUCKET_MB="1024"), "--dry-run")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    oa, ob = overrides_of(a.stdout), overrides_of(b.stdout)
    diff = {k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k)}
    assert diff == {FLASHRL_KEY, BUCKET_KEY}, diff
    assert oa[FLASHRL_KEY].endswith(".w4a8_profile_free.yaml") and ob[FLASHRL_KEY].endswith(".bf16.yaml")


def test_the_32b_w4a8_dry_run_sets_up_a_w4a8_config(inputs):  # noqa: F811
    model = inputs["tmp"] / "models" / "Qwen2.5-32B-Instruct"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = run(MEG32_W4A8, dict(inputs["env"], MODEL_PATH=str(model)), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    config = inputs["tmp"] / "run" / "configs" / "Qwen2.5-32B-Instruct.w4a8_profile_free.yaml"
    assert f"npu-flashrl setup -m {model} --fn w4a8_profile_free -o {config}" in proc.stdout.replace(" \\\n    ", " ")
    assert "npu-flashrl profile" not in proc.stdout
    assert overrides_of(proc.stdout)["trainer.experiment_name"] == "qwen25_32b_megatron_w4a8_A2_verl09"


@pytest.mark.parametrize("script, fn, needle", [
    (W4A8_CONFIG, "int8_profile_free", "ROLLOUT_PRECISION=w4a8 but FLASHRL_CONFIG {cfg} has fn: "
                                       "int8_profile_free (a int8 rollout)"),
    (W4A8_CONFIG, "bf16", "ROLLOUT_PRECISION=w4a8 but FLASHRL_CONFIG {cfg} has fn: bf16"),
    (V09_CONFIG, "w4a8_profile_free", "ROLLOUT_PRECISION=int8 but FLASHRL_CONFIG {cfg} has fn: "
                                      "w4a8_profile_free (a w4a8 rollout)"),
], ids=["w4a8-run-int8-config", "w4a8-run-bf16-config", "int8-run-w4a8-config"])
def test_the_preflight_holds_the_config_to_the_precision(inputs, tmp_path, script, fn, needle):  # noqa: F811
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text(f"configs:\n  - fn: {fn}\n")
    proc = run(script, dict(inputs["env"], FLASHRL_CONFIG=str(cfg)), "--dry-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert needle.format(cfg=cfg) in proc.stderr, proc.stderr
    assert "verl.trainer.main_ppo" not in proc.stdout
    cfg.write_text("configs:\n  - fn: w4a8_profile_free\n")
    if script == W4A8_CONFIG:
        assert run(script, dict(inputs["env"], FLASHRL_CONFIG=str(cfg)), "--dry-run").returncode == 0


def test_the_w4a8_launch_passes_verls_own_checks(inputs, tmp_path):  # noqa: F811
    """The W4A8 launch's command with the preflight's verl checks on (verl 0.9.1's config tree,
    `validate_config`, the rollout config's `__post_init__`), as tests/recipes/
    test_recipe_verl_checks.py runs the INT8 one."""
    from npu_flashrl.lines import verl as verl_lines

    if importlib.util.find_spec("verl") is None or verl_lines.verl_line() != verl_lines.SERVER:
        pytest.skip("verl's own checks need the server-mode verl (the current line's venv)")
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: w4a8_profile_free\n")
    # verl's checks import verl and torch: more than `run`'s minute on a loaded machine
    proc = subprocess.run(["bash", str(W4A8_CONFIG), "--dry-run"], capture_output=True, text=True, timeout=600,
                          env=dict(inputs["env"], FLASHRL_CONFIG=str(cfg), NPU_FLASHRL_PREFLIGHT_VERL="1"))
    assert proc.returncode == 0, proc.stderr
    assert "verl.trainer.main_ppo" in proc.stdout


QWEN25_7B_DIMS = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "num_attention_heads": 28,
                  "intermediate_size": 18944, "max_position_embeddings": 32768}


def test_the_preflight_holds_the_group_size_to_the_rollouts_tp_split(inputs, tmp_path):  # noqa: F811
    """Qwen2.5-7B's dims at the recipe's rollout TP 4: o_proj holds 896 and down_proj 4736 input
    channels per rank, so group_size 256 (vllm-ascend's default) leaves a remainder the W4A8 scheme
    refuses at engine build; the preflight refuses it before launch, from SETUP_EXTRA (before setup
    wrote the config) and from the FlashRL config's entry, and names a group size that fits."""
    import json

    model = inputs["tmp"] / "models" / "Qwen2.5-7B-dims"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B_DIMS))
    env = dict(inputs["env"], MODEL_PATH=str(model))
    bad = run(W4A8, dict(env, SETUP_EXTRA="group_size=256"), "--dry-run")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert ("group_size 256 (SETUP_EXTRA=group_size=256) does not divide the model's row-parallel input dims at "
            "rollout tensor-parallel size 4") in bad.stderr, bad.stderr
    assert "o_proj 3584 input channels (896 per rank)" in bad.stderr and "group_size=128" in bad.stderr
    assert "verl.trainer.main_ppo" not in bad.stdout
    assert run(W4A8, env, "--dry-run").returncode == 0  # the recipe's default, group_size=128
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text(f"configs:\n  - fn: w4a8_profile_free\n    model: {model}\n")
    proc = run(W4A8_CONFIG, dict(env, FLASHRL_CONFIG=str(cfg)), "--dry-run")
    assert proc.returncode == 1 and f"({cfg}: configs[0] (the default group size))" in proc.stderr, proc.stderr
    cfg.write_text(f"configs:\n  - fn: w4a8_profile_free\n    model: {model}\n    group_size: 64\n")
    assert run(W4A8_CONFIG, dict(env, FLASHRL_CONFIG=str(cfg)), "--dry-run").returncode == 0
