"""`npu-flashrl preflight` (npu_flashrl/recipes), the one home of the verl recipes' rules, called
directly: the declared recipe variables (type, range, choices, the recipes that read them), the
rules applied to an assembled verl command (layout, the verl line's TIS / server-mode /
checkpoint-engine / MoE rules, rollout dtype), and one reading of a command shared with
`npu-flashrl verify --verl-overrides`. No recipe is spawned here (tests/test_deploy_recipes*.py
drive the recipes' --dry-run); only yaml and text are read, no verl is imported.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.recipes import preflight as P
from npu_flashrl.recipes import variables as V
from npu_flashrl.recipes.command import read_command, read_words

SYNC, SERVER = verl_lines.SYNC, verl_lines.SERVER
RO = "actor_rollout_ref.rollout."
MAIN = ["python3", "-m", "verl.trainer.main_ppo"]
OSO = ["python3", "-m", "verl.experimental.one_step_off_policy.main_ppo"]
RAY = {"RAY_ADDRESS": "10.0.0.1:6379"}  # a multi-node run's Ray cluster


# ------------------------------------------------------------------------------------ variables

BAD_VALUES = {  # name: (environment, features, words the message must hold)
    "staleness_word": ({"STALENESS": "abc"}, ["async", "fully_async"], ["STALENESS", "'abc'", "a finite number"]),
    "tp_padded": ({"ROLLOUT_TP": " 4"}, [], ["ROLLOUT_TP", "' 4'", "no spaces"]),
    "tp_trailing_space": ({"NNODES": "2 "}, [], ["NNODES", "'2 '"]),
    "bool_maybe": ({"VANILLA_MBRIDGE": "maybe"}, ["megatron"], ["VANILLA_MBRIDGE", "'maybe'", "True or False"]),
    "enum_recompute": ({"RECOMPUTE_GRANULARITY": "everything"}, ["megatron"],
                       ["RECOMPUTE_GRANULARITY", "'everything'", "full, selective"]),
    "ckpt_engine_hccl": ({"CHECKPOINT_ENGINE": "hccl"}, ["async"], ["CHECKPOINT_ENGINE", "'hccl'", "nccl"]),
    "nnodes_overflow": ({"NNODES": "9223372036854775808"}, [], ["NNODES", "'9223372036854775808'"]),
    "tp_overflow": ({"TRAIN_TP": "4294967296"}, ["megatron"], ["TRAIN_TP", "<= 65536"]),
    "npus_injection": ({"NPUS_PER_NODE": "HOME[$(touch x)]"}, [], ["NPUS_PER_NODE"]),
    "nnodes_octal": ({"NNODES": "08"}, [], ["NNODES", "'08'"]),
    "tp_zero": ({"ROLLOUT_TP": "0"}, [], ["ROLLOUT_TP", ">= 1"]),
    "lr_word": ({"LR": "fast"}, [], ["LR must be", "'fast'"]),
    "gpu_mem_above_one": ({"GPU_MEMORY_UTILIZATION": "1.5"}, [], ["GPU_MEMORY_UTILIZATION", "<= 1"]),
    "tis_threshold_zero": ({"TIS_THRESHOLD": "0"}, [], ["TIS_THRESHOLD", "> 0", "'0'"]),
    "tis_level_word": ({"TIS_LEVEL": "tokens"}, [], ["TIS_LEVEL", "null, token, sequence"]),
    "lmhead_maybe": ({"FLASHRL_LMHEAD_FP32": "maybe"}, [], ["FLASHRL_LMHEAD_FP32", "'maybe'", "yes/no"]),
    "kl_type": ({"KL_LOSS_TYPE": "kl3"}, [], ["KL_LOSS_TYPE", "'kl3'", "low_var_kl"]),
    "bucket_huge": ({"UPDATE_WEIGHTS_BUCKET_MB": "2000000"}, ["current"], ["UPDATE_WEIGHTS_BUCKET_MB", "1048576"]),
    "fn_word": ({"FLASHRL_FN": "int4"}, ["entry"], ["FLASHRL_FN", "int8_profile_free"]),
    "async_mode": ({"ASYNC_MODE": "both"}, ["async"], ["ASYNC_MODE", "one_step_off, fully_async"]),
    "two_lines": ({"NOT_A_RECIPE_VARIABLE": "x", "TRAIN_BATCH_SIZE": "16\n8"}, [], ["TRAIN_BATCH_SIZE", "one line"]),
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_variable_values_are_named(name):
    environ, features, needles = BAD_VALUES[name]
    problems, _, values = V.check_variables(environ, features)
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], (needle, problems[0])
    assert not set(values) & set(environ)


def test_good_values_pass_and_booleans_are_normalised():
    env = {"USE_DYNAMIC_BSZ": "1", "ENFORCE_EAGER": "false", "TIS_THRESHOLD": "2", "LR": "5e-8", "SAVE_FREQ": "-1",
           "GPU_MEMORY_UTILIZATION": "1", "STALENESS": "0", "CHECKPOINT_ENGINE": "nccl", "KL_LOSS_TYPE": "k3+",
           "FLASHRL_LMHEAD_FP32": "yes", "RECOMPUTE_GRANULARITY": "selective"}
    problems, notes, values = V.check_variables(env, ["async", "fully_async", "megatron"])
    assert problems == [] and notes == []
    assert values["USE_DYNAMIC_BSZ"] == "True" and values["ENFORCE_EAGER"] == "False"
    assert values["FLASHRL_LMHEAD_FP32"] == "yes"  # npu_flashrl's switch keeps its spelling


def test_a_variable_the_recipe_does_not_read_is_said():
    problems, notes, _ = V.check_variables({"TRAIN_TP": "2", "UPDATE_WEIGHTS_BUCKET_MB": "512"}, ["fsdp", "pinned"])
    assert problems == []
    assert any(n.startswith("TRAIN_TP='2' is set but this recipe does not read it") for n in notes), notes
    assert any("UPDATE_WEIGHTS_BUCKET_MB" in n and "current" in n for n in notes), notes
    # the entry scripts check every variable their config script may read, without notes
    assert V.check_variables({"TRAIN_TP": "2"}, ["entry", "any"])[:2] == ([], [])


def test_policy_gradient_on_the_server_line_is_refused():
    problems, _, _ = P.vars_phase({"TIS_USE_POLICY_GRADIENT": "True"}, ["fsdp", "current"])
    assert len(problems) == 1 and "has no algorithm.rollout_correction.use_policy_gradient" in problems[0]
    assert P.vars_phase({"TIS_USE_POLICY_GRADIENT": "True"}, ["fsdp", "pinned"])[0] == []


@pytest.mark.parametrize("fn", ["int8", "int8_fast", "int8_wo_prune"])
def test_moe_entry_refuses_the_profile_fns(fn):
    problems, _, _ = P.vars_phase({"FLASHRL_FN": fn}, ["entry", "any", "moe"])
    assert any("no entries for MoE experts" in p for p in problems), problems
    assert P.vars_phase({"FLASHRL_FN": "int8_profile_free"}, ["entry", "any", "moe"])[0] == []


def test_lmhead_spellings_are_npu_flashrl_configs():
    """The preflight's FLASHRL_LMHEAD_FP32 (torch-free) accepts exactly what the runtime's parser does."""
    from npu_flashrl.config import ConfigError, lmhead_fp32_requested

    var = V.BY_NAME["FLASHRL_LMHEAD_FP32"]
    for raw in ["1", "0", "true", "False", "YES", "no", "on", "Off", "maybe", "2", "enabled"]:
        try:
            expected = lmhead_fp32_requested({"FLASHRL_LMHEAD_FP32": raw})
        except ConfigError:
            expected = None
        value, problem = V.parse(var, raw)
        assert (problem is None) == (expected is not None), raw
        if expected is not None:
            assert V.bool_on(value) is expected, raw


def test_profile_fns_are_the_configs_int8_aliases():
    from npu_flashrl import config

    assert set(P.PROFILE_FNS) == {config.FN_INT8} | {k for k, v in config.FN_ALIASES.items() if v == config.FN_INT8}


def test_checkpoint_engines_are_verls_registry():
    """The backend names the preflight accepts are what verl 0.9.1 registers (read from its source)."""
    from test_recipes import schema_dir_091

    found = set()
    for root, _, files in os.walk(os.path.join(schema_dir_091(), "checkpoint_engine")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), encoding="utf-8") as fh:
                    found |= set(re.findall(r'CheckpointEngineRegistry\.register\("([^"]+)"\)', fh.read()))
    assert found == set(verl_lines.CHECKPOINT_ENGINES)
    assert "hccl" not in found


# ------------------------------------------------------------------------------------ reading a command

OVERRIDES = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "+ray_kwargs.ray_init.x='a b'",
             "~trainer.logger"]


@pytest.mark.parametrize("prefix", [
    "python3 -m",
    "VAR=1 OTHER='x y' python3 -m",
    "env VAR=1 /usr/bin/python3 -m",
    "env -u HOME -i VAR=1 python3 -m",
    "FOO=2 env -- VAR=1 python -m",
])
@pytest.mark.parametrize("entry", [verl_lines.ENTRY_MAIN, *verl_lines.ENTRY_EXPERIMENTAL, "verl.trainer.main_generation"])
def test_a_command_reads_the_same_whatever_comes_before_it(prefix, entry):
    text = f"# dry run, not executed:\n{prefix} {entry} \\\n    --config-name=ppo_megatron_trainer \\\n    " \
           + " \\\n    ".join(OVERRIDES) + "\n"
    cmd = read_command(text)
    assert cmd.entry == entry
    assert cmd.overrides == ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "+ray_kwargs.ray_init.x=a b",
                             "~trainer.logger"]
    assert cmd.config_name == "ppo_megatron_trainer"
    assert cmd.env.get("VAR", "1") == "1" and "python3" not in cmd.env
    assert cmd.experimental == (entry in verl_lines.ENTRY_EXPERIMENTAL)


def test_other_commands_of_a_dry_run_are_not_the_launch():
    text = ("mkdir -p /r/configs\nnpu-flashrl setup -m /m --fn int8_profile_free -o /r/c.yaml wire=int8\n"
            "env FLASHRL_CONFIG=/r/c.yaml python3 -m verl.trainer.main_ppo a.b=1\n")
    cmd = read_command(text)
    assert cmd.overrides == ["a.b=1"] and cmd.env == {"FLASHRL_CONFIG": "/r/c.yaml"}
    below = read_command("FLASHRL_CONFIG=c.yaml python3 -m verl.trainer.main_ppo\na.b=1\n\n~c.d\nmkdir x\ne.f=2\n")
    assert below.overrides == ["a.b=1", "~c.d"] and below.env == {"FLASHRL_CONFIG": "c.yaml"}
    plain = read_command("a.b=1\n# comment\nc.d=2\n")
    assert plain.entry is None and plain.overrides == ["a.b=1", "c.d=2"]


# ------------------------------------------------------------------------------------ rules on a command

def problems(words, line=SERVER, env=None, features=("fsdp",), node=None):
    environ = {"FLASHRL_CONFIG": "", **(env or {})}
    return P.check_command(read_words(list(words)), line, environ, list(features), node)


def one(words, needles, **kw):
    found = problems(words, **kw)
    assert len(found) == 1, found
    for needle in needles:
        assert needle in found[0], (needle, found[0])
    return found[0]


def async_cmd(trainer=4, rollout=4, tp=4, rnodes=1, nnodes=1):
    return [*OSO, f"trainer.n_gpus_per_node={trainer}", f"trainer.nnodes={nnodes}", f"rollout.n_gpus_per_node={rollout}",
            f"rollout.nnodes={rnodes}", f"{RO}tensor_model_parallel_size={tp}", f"{RO}checkpoint_engine.backend=nccl"]


def test_rollout_tp_against_the_colocated_node():
    one([*MAIN, "trainer.n_gpus_per_node=8", f"{RO}tensor_model_parallel_size=3"],
        ["ROLLOUT_TP=3", "must divide NPUS_PER_NODE=8"])
    assert problems([*MAIN, "trainer.n_gpus_per_node=8", f"{RO}tensor_model_parallel_size=4"]) == []
    # without a recipe (verify): the keys are named
    found = P.check_command(read_words([*MAIN, f"{RO}tensor_model_parallel_size=16"]), SERVER, {})
    assert len(found) == 1 and found[0].startswith(f"{RO}tensor_model_parallel_size=16 must divide trainer.n_gpus_per_node=8")


def test_rollout_tp_against_the_rollout_pool():
    """TRAINER_NPUS=2 ROLLOUT_NPUS=4 ROLLOUT_TP=4 runs (the rollout replicas are on the rollout
    pool); ROLLOUT_TP against too small a rollout pool names ROLLOUT_NPUS."""
    feats = ("fsdp", "async")
    assert problems(async_cmd(trainer=2, rollout=4, tp=4), features=feats, node=8) == []
    one(async_cmd(trainer=4, rollout=2, tp=4), ["ROLLOUT_TP=4", "must divide ROLLOUT_NPUS=2 (rollout.n_gpus_per_node)"],
        features=feats, node=8)


def test_pools_over_several_nodes_need_a_ray_cluster():
    """docs/scale_out.md section 7: 8 trainer NPUs and 8 rollout NPUs on each of 2 rollout nodes."""
    feats = ("fsdp", "async")
    layout = async_cmd(trainer=8, rollout=8, tp=4, rnodes=2)
    assert problems(layout, env={"RAY_ADDRESS": "10.0.0.1:6379"}, features=feats, node=8) == []
    one(layout, ["RAY_ADDRESS is empty", "exceed NPUS_PER_NODE=8"], features=feats, node=8)
    one(async_cmd(trainer=6, rollout=4), ["TRAINER_NPUS=6 + ROLLOUT_NPUS=4 exceed NPUS_PER_NODE=8", "RAY_ADDRESS"],
        features=feats, node=8)
    one(async_cmd(trainer=16, rollout=4), ["TRAINER_NPUS=16 (trainer.n_gpus_per_node) exceeds NPUS_PER_NODE=8"],
        env={"RAY_ADDRESS": "h:6379"}, features=feats, node=8)


@pytest.mark.parametrize("sizes, ok", [((3, 1, 1), False), ((4, 4, 1), True), ((4, 2, 1), True), ((4, 1, 3), False)])
def test_megatron_parallelism_divides_the_trainers_npus(sizes, ok):
    tp, pp, cp = sizes
    meg = "actor_rollout_ref.actor.megatron."
    words = [*MAIN, "--config-name=ppo_megatron_trainer", "trainer.n_gpus_per_node=8", "trainer.nnodes=2",
             "actor_rollout_ref.actor.strategy=megatron", f"{meg}tensor_model_parallel_size={tp}",
             f"{meg}pipeline_model_parallel_size={pp}", f"{meg}context_parallel_size={cp}", f"{meg}use_mbridge=True"]
    if ok:
        assert problems(words, features=("megatron",), env=RAY) == []
    else:
        one(words, [f"TRAIN_TP={tp}", f"TRAIN_PP={pp}", "must divide the trainer's 16 NPUs"], features=("megatron",),
            env=RAY)


@pytest.mark.parametrize("backend, ok", [("hccl", False), ("nccl", True), ("naive", True), ("nixl", True)])
def test_checkpoint_engine_names_are_verls(backend, ok):
    words = [*OSO, f"{RO}checkpoint_engine.backend={backend}"]
    if ok:
        assert problems(words, features=()) == []
    else:
        one(words, [f"{RO}checkpoint_engine.backend=hccl", "CheckpointEngineRegistry", "nccl"], features=())


def test_delta_sharded_only_with_a_bf16_rollout(tmp_path):
    int8 = tmp_path / "int8.yaml"
    int8.write_text("configs: [{fn: int8_profile_free, wire: int8}]\n")
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text("configs:\n  - fn: bf16\n")
    words = [*OSO, f"{RO}checkpoint_engine.backend=delta_sharded"]
    one(words, ["CHECKPOINT_ENGINE=delta_sharded", "INT8 FLASHRL_CONFIG"], env={"FLASHRL_CONFIG": str(int8)},
        features=("fsdp", "async"))
    assert problems(words, env={"FLASHRL_CONFIG": str(bf16), "VLLM_PLUGINS": ""}) == []


@pytest.mark.parametrize("dtype, ok", [("int8", False), ("torch.int8", False), ("bfloat16", True), ("float16", True)])
def test_rollout_dtype_must_be_a_float_type(dtype, ok):
    words = [*MAIN, f"{RO}dtype={dtype}"]
    if ok:
        assert problems(words, line=SYNC) == []
    else:
        one(words, [f"{RO}dtype={dtype}", "float model dtype", "FLASHRL_CONFIG"], line=SYNC)


SERVER_REFUSALS = [
    ([f"{RO}mode=sync"], {}, "removed the sync rollout mode"),
    ([f"{RO}quantization=fp8"], {}, "drop actor_rollout_ref.rollout.quantization"),
    ([f"+{RO}engine_kwargs.vllm.quantization=ascend"], {}, "drop actor_rollout_ref.rollout.engine_kwargs.vllm.quantization"),
    ([f"{RO}qat.enable=True"], {}, "drop actor_rollout_ref.rollout.qat.enable"),
    ([], {"VLLM_PLUGINS": "other_plugin"}, "leaves out npu_flashrl"),
    ([], {"VLLM_ASCEND_ENABLE_NZ": "1"}, "refuses to wake the engine from sleep mode"),
    (["+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ASCEND_ENABLE_NZ='1'"], {}, "VLLM_ASCEND_ENABLE_NZ=1 reaches"),
    (["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.rollout_is=token"], {},
     "for metrics only"),
    (["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.rollout_is=token",
      "algorithm.rollout_correction.loss_type=reinforce"], {}, "driver's copy of actor.policy_loss only"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"], {}, "ignores the batch's rollout_is_weights"),
    (["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.loss_type=pg"], {},
     "takes ppo_clip or reinforce"),
    (["actor_rollout_ref.model.use_fused_kernels=True"], {"FLASHRL_LMHEAD_FP32": "1"}, "fused kernels"),
]


@pytest.mark.parametrize("extra, env, needle", SERVER_REFUSALS, ids=[n for _, _, n in SERVER_REFUSALS])
def test_server_line_refusals(tmp_path, extra, env, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("configs:\n  - fn: int8_profile_free\n")
    found = problems([*MAIN, *extra], env={"FLASHRL_CONFIG": str(cfg), **env})
    assert len(found) == 1 and needle in found[0], found
    if "bypass" in " ".join(extra) or "loss_mode" in " ".join(extra):  # the recipe's fix is named
        assert found[0].endswith("in the recipe: TIS_BYPASS_MODE=False")


def test_sync_line_tis_refusal_names_the_recipe_fix():
    found = problems([*MAIN, "actor_rollout_ref.rollout.mode=sync", "algorithm.rollout_correction.bypass_mode=True",
                      "algorithm.rollout_correction.use_policy_gradient=True",
                      "algorithm.rollout_correction.rollout_is=sequence"], line=SYNC)
    assert len(found) == 1
    assert "never reaches the Ray workers" in found[0] and "bypass mode computes no IS weights" in found[0]
    assert found[0].endswith("in the recipe: TIS_BYPASS_MODE=False TIS_USE_POLICY_GRADIENT=False")


EPLB = "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config."


@pytest.mark.parametrize("extra, needle", [
    ([f"{RO}expert_parallel_size=2"], "expert_parallel_size = tensor_model_parallel_size x data_parallel_size"),
    ([EPLB + "dynamic_eplb=True"], "dynamic EPLB moves experts"),
    ([EPLB + "expert_map_path=/x/map.json"], "expert map turns vllm-ascend's dynamic EPLB on"),
    ([EPLB + "num_redundant_experts=16"], "several physical copies"),
    (["+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_eplb=True"], "dynamic EPLB"),
])
def test_moe_refusals(tmp_path, extra, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("configs:\n- fn: int8_profile_free\n")
    base = [*MAIN, f"{RO}tensor_model_parallel_size=4", f"{RO}data_parallel_size=1", f"{RO}expert_parallel_size=4"]
    env = {"FLASHRL_CONFIG": str(cfg), "VLLM_PLUGINS": ""}
    assert problems(base + [EPLB + "dynamic_eplb=False", EPLB + "num_redundant_experts=0"], env=env,
                    features=("fsdp", "moe")) == []
    one(base + extra, [needle], env=env, features=("fsdp", "moe"))
    if "expert_parallel_size" not in extra[0]:  # a bf16 rollout has no INT8 experts to reload
        bf16 = tmp_path / "b.yaml"
        bf16.write_text("configs: [{fn: bf16}]\n")
        assert problems(base + extra, env={"FLASHRL_CONFIG": str(bf16)}, features=("fsdp", "moe")) == []


@pytest.mark.parametrize("text, refused", [
    ("configs:\n  - fn: int8\n    profile: /x.pt\n", True),
    ("configs: [{fn: int8, profile: /x.pt}]\n", True),             # flow style
    ("configs:\n- {fn: 'int8_fast', profile: /x.pt}\n", True),      # FlashRL's alias of int8
    ("configs:\n- fn: int8_profile_free  # fn: int8 would need a profile\n", False),
    ("configs:\n- fn: int8_profile_free\n  comment: 'fn: int8'\n", False),
])
def test_moe_fn_read_from_the_yaml(tmp_path, text, refused):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    found = problems([*MAIN], env={"FLASHRL_CONFIG": str(cfg), "VLLM_PLUGINS": ""}, features=("fsdp", "moe"))
    assert any("no entries for MoE experts" in p for p in found) == refused, found


def test_launch_phase_lints_against_the_installed_verl_of_the_line(monkeypatch):
    """A misspelt key is refused before anything starts when the installed verl runs the recipe's
    line; with another line's verl installed the lint is skipped and said (a real run then refuses
    the line itself)."""
    from test_recipes import schema_dir_091

    config_dir = os.path.join(schema_dir_091(), "trainer", "config")  # skip without verl 0.9.1's yaml
    monkeypatch.setattr(verl_lines, "verl_line", lambda *a, **k: SERVER)
    monkeypatch.setattr(P.importlib.util, "find_spec", lambda name: object())
    from npu_flashrl.recipes import lint

    monkeypatch.setattr(lint, "find_verl_config_dir", lambda verl_dir=None: config_dir)
    words = [*MAIN, f"{RO}calculate_log_prob=True"]
    found, _ = P.launch_phase(words, {}, ["fsdp"], SERVER, True, None, "hint")
    assert len(found) == 1 and "unknown key 'actor_rollout_ref.rollout.calculate_log_prob'" in found[0], found
    monkeypatch.setattr(verl_lines, "verl_line", lambda *a, **k: SYNC)
    found, notes = P.launch_phase(words, {}, ["fsdp"], SERVER, True, None, "hint")
    assert found == []


def test_the_cli_prints_values_and_exits_3_on_refusal(capsys, monkeypatch):
    monkeypatch.setenv("USE_DYNAMIC_BSZ", "1")
    assert P.main(["vars", "--features", "fsdp"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "USE_DYNAMIC_BSZ=True" in out and out[-1] == "NPU_FLASHRL_PREFLIGHT=ok"
    monkeypatch.setenv("ROLLOUT_TP", "four")
    assert P.main(["vars", "--features", "fsdp", "--name", "r"]) == P.REFUSED
    err = capsys.readouterr().err
    assert "[r] ERROR: ROLLOUT_TP must be an integer" in err
    assert P.main(["launch", "--features", "fsdp", "--dry-run", "--", *MAIN, f"{RO}dtype=int8"]) == P.REFUSED


def test_preflight_is_registered_in_the_cli(capsys):
    from npu_flashrl import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["preflight", "--help"])
    assert exc.value.code == 0 and "vars" in capsys.readouterr().out


def test_preflight_does_not_import_torch():
    """It runs on every --dry-run with the recipe's interpreter: no torch, no adapters."""
    import subprocess

    code = ("import sys, npu_flashrl.recipes.preflight as p; p.main(['vars']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm') or "
            "m.startswith('npu_flashrl.adapters')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, NPU_FLASHRL_NO_AUTOACTIVATE="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------------------------ verify --verl-overrides

@pytest.mark.parametrize("prefix", ["python3 -m", "FLASHRL_LMHEAD_FP32=0 python3 -m", "env HOME=/x python3 -m",
                                    "env -u HOME VAR='a b' /usr/bin/python3 -m"])
@pytest.mark.parametrize("entry", [verl_lines.ENTRY_MAIN, *verl_lines.ENTRY_EXPERIMENTAL])
def test_verify_reads_every_entry_point_and_prefix_alike(tmp_path, prefix, entry):
    """verify --verl-overrides finds the overrides whatever the entry point and whatever comes
    before it, and refuses what cannot run (rollout.dtype=int8) whatever it is."""
    from npu_flashrl import verify

    good = ("algorithm.rollout_correction.rollout_is=token actor_rollout_ref.rollout.calculate_log_probs=True "
            "algorithm.rollout_correction.bypass_mode=False")
    for extra, status in (("", verify.OK), (f" {RO}dtype=int8", verify.FAIL), (f" {RO}mode=sync", verify.FAIL)):
        f = tmp_path / "cmd.txt"
        f.write_text(f"{prefix} {entry} \\\n  {good}{extra}\n")
        rows = verify.verl_rows(str(f), verl=SERVER)
        assert [r["status"] for r in rows] == [status], rows
        if status == verify.OK:
            assert rows[0]["detail"].startswith("3 overrides"), rows
        else:
            assert extra.strip() in rows[0]["detail"], rows


# ------------------------------------------------------------------------------------ the user's words (issue 37)

@pytest.mark.parametrize("name, raw, needle", [
    ("LR", "1e999", "a finite number"),  # float('1e999') is inf
    ("KL_LOSS_COEF", "1e999", "a finite number"),
    ("HCCL_CONNECT_TIMEOUT", "1", "[120, 7200]"),  # CANN's documented range
    ("HCCL_CONNECT_TIMEOUT", "946080000", "[120, 7200]"),  # about 30 years
    ("HCCL_EXEC_TIMEOUT", "99999999999", "2147483647"),
    ("RAY_ADDRESS", "my cluster", "host:port"),
    ("RAY_ADDRESS", "10.0.0.1", "host:port"),
])
def test_numbers_are_finite_and_within_documented_ranges(name, raw, needle):
    problems, _, _ = V.check_variables({name: raw}, ["fsdp"])
    assert len(problems) == 1 and name in problems[0] and needle in problems[0], problems


@pytest.mark.parametrize("name, raw", [("HCCL_EXEC_TIMEOUT", "0"), ("HCCL_CONNECT_TIMEOUT", "7200"),
                                       ("RAY_ADDRESS", "auto"), ("RAY_ADDRESS", "10.0.0.1:6379"),
                                       ("RAY_ADDRESS", "ray://head.example:10001")])
def test_documented_values_are_accepted(name, raw):
    assert V.check_variables({name: raw}, ["fsdp"])[0] == []


def test_every_default_lives_in_variables_and_the_job_says_where_each_came_from():
    """The recipe defaults are `Var.default` (issue 38): line-dependent (TIS_LEVEL), derived
    (PPO_MAX_TOKEN_LEN from the lengths the user set, paths from HOME and DATASET), constants."""
    env = {"HOME": "/h", "MAX_PROMPT_LENGTH": "100", "DATASET": "dapo"}
    for line, tis in (("current", "token"), ("pinned", "sequence")):
        problems, _, job = V.resolve_job(env, ["fsdp", line], line, "qwen")
        assert problems == []
        got = {name: (value, source) for name, value, source in job}
        assert got["TIS_LEVEL"] == (tis, "derived")
        assert got["PPO_MAX_TOKEN_LEN"] == ("10340", "derived")
        assert got["MAX_PROMPT_LENGTH"] == ("100", "environment")
        assert got["LR"] == ("5e-8", "default")
        assert got["TRAIN_FILE"] == ("/h/data/dapo/train.parquet", "derived")
        assert got["EXPERIMENT_NAME"][0] == "qwen_int8_A2" + ("_verl09" if line == "current" else "")
        assert "TRAIN_TP" not in got and "QUANT_MODEL_PATH" not in got  # megatron / entry only
    # the entry scripts: their own defaults (the profile and config paths), ROLLOUT_PRECISION from FLASHRL_FN
    _, _, job = V.resolve_job({"HOME": "/h", "FLASHRL_FN": "bf16"}, ["entry", "any", "current"], "current")
    got = {name: value for name, value, _ in job}
    assert got["ROLLOUT_PRECISION"] == "bf16"
    assert got["FLASHRL_CONFIG"] == "/h/npu_flashrl_runs/configs/Qwen2.5-7B-Instruct.bf16.yaml"


def test_the_vars_phase_prints_the_resolved_job(capsys, monkeypatch):
    monkeypatch.setenv("LR", "1e-6")
    assert P.main(["vars", "--features", "fsdp", "--line", "current", "--resolve", "--experiment", "x",
                   "--name", "r"]) == 0
    out, err = capsys.readouterr()
    assert "LR=1e-6" in out.splitlines() and "PPO_MAX_TOKEN_LEN=12288" in out.splitlines()
    assert "[r]   environment  LR=1e-6" in err and "[r]   derived      PPO_MAX_TOKEN_LEN=12288" in err


def test_grpo_with_one_response_per_prompt_is_refused():
    one([*MAIN, "algorithm.adv_estimator=grpo", f"{RO}n=1"], ["ROLLOUT_N=1", "compute_grpo_outcome_advantage"])
    assert problems([*MAIN, "algorithm.adv_estimator=grpo", f"{RO}n=2"]) == []


def test_several_colocated_nodes_need_a_ray_cluster():
    one([*MAIN, "trainer.nnodes=2"], ["NNODES=2", "RAY_ADDRESS is empty"])
    assert problems([*MAIN, "trainer.nnodes=2"], env={"RAY_ADDRESS": "10.0.0.1:6379"}) == []


def test_an_int8_run_with_a_bf16_config_is_refused(tmp_path):
    cfg = tmp_path / "bf16.yaml"
    cfg.write_text("configs:\n- fn: bf16\n")
    one([*MAIN], ["ROLLOUT_PRECISION=int8", "only fn: bf16"], env={"FLASHRL_CONFIG": str(cfg), "ROLLOUT_PRECISION": "int8"})
    assert problems([*MAIN], env={"FLASHRL_CONFIG": str(cfg), "ROLLOUT_PRECISION": "bf16"}) == []


@pytest.mark.parametrize("value, refused", [("0.0", False), ("00", False), ("0", False), ("1", True), ("2.0", True)])
def test_redundant_experts_read_as_a_number(tmp_path, value, refused):
    cfg = tmp_path / "int8.yaml"
    cfg.write_text("configs:\n- fn: int8_profile_free\n")
    found = problems([*MAIN, f"+{RO}engine_kwargs.vllm.additional_config.num_redundant_experts={value}"],
                     env={"FLASHRL_CONFIG": str(cfg)}, features=("fsdp", "moe"))
    assert bool(found) == refused, found


# ------------------------------------------------------------------------------------ the model's own limits

def model_dir(tmp_path, config):
    import json

    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(d)


def launch_with_model(path, prompt=2048, response=10240, env=None, extra=()):
    words = [*MAIN, f"actor_rollout_ref.model.path={path}", f"data.max_prompt_length={prompt}",
             f"data.max_response_length={response}", *extra]
    return P.launch_phase(words, {"NPU_FLASHRL_PREFLIGHT_VERL": "0", **(env or {})}, ["fsdp"], SERVER, True, None, "h")


QWEN = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768}


def test_a_context_past_the_models_positions_is_refused(tmp_path):
    path = model_dir(tmp_path, QWEN)
    found, _ = launch_with_model(path, 2048, 40000)
    assert len(found) == 1 and "42048 tokens" in found[0] and "max_position_embeddings=32768" in found[0], found
    assert launch_with_model(path, 2048, 10240)[0] == []
    # vLLM's own opt-in: said, not refused
    found, notes = launch_with_model(path, 2048, 40000, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert found == [] and any("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in n for n in notes), notes
    # an explicit rollout.max_model_len is what vLLM checks
    assert launch_with_model(path, 2048, 40000, extra=[f"{RO}max_model_len=30000"])[0] == []


def test_rope_scaling_extends_the_limit_as_vllm_reads_it(tmp_path):
    path = model_dir(tmp_path, dict(QWEN, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 32768}))
    assert launch_with_model(path, 2048, 100000)[0] == []
    found, _ = launch_with_model(path, 2048, 140000)
    assert len(found) == 1 and "131072" in found[0], found


@pytest.mark.parametrize("config, needle, refused", [
    ({"max_position_embeddings": 32768}, "has no `architectures`", False),
    ({"architectures": "Qwen2ForCausalLM", "max_position_embeddings": 32768}, "must be a list of class names", True),
    ("{not json", "not a readable JSON config", True),
    ("[1, 2]", "expected a JSON object", True),
])
def test_the_models_architectures_are_read_as_vllm_reads_them(tmp_path, config, needle, refused):
    found, notes = launch_with_model(model_dir(tmp_path, config))
    said = found if refused else notes
    assert any(needle in m for m in said), (found, notes)
    if not refused:
        assert found == []


def test_coverage_is_said_for_the_recipes_line(tmp_path, monkeypatch):
    """An architecture whose tests do not run on the recipe's stack line is said to be not
    verified there; one not covered at all gets architectures.py's message."""
    from npu_flashrl import architectures
    from npu_flashrl.recipes import model_check

    arch = architectures.covered("Qwen2ForCausalLM")
    monkeypatch.setattr(architectures, "COVERED", (architectures.Architecture(
        arch.name, arch.family, arch.cells, arch.tests, (model_check.STACK_OF["pinned"],), arch.note),))
    _, notes = launch_with_model(model_dir(tmp_path, QWEN))
    assert any("not verified on this line" in n and model_check.STACK_OF["current"] in n for n in notes), notes
    _, notes = launch_with_model(model_dir(tmp_path, dict(QWEN, architectures=["GPT2LMHeadModel"])))
    assert any("GPT2LMHeadModel is not covered" in n for n in notes), notes


# ------------------------------------------------------------------------------------ the CLI leftovers

def test_a_misspelt_feature_is_refused_not_turned_into_notes(capsys, monkeypatch):
    monkeypatch.setenv("TRAIN_TP", "2")
    assert P.main(["vars", "--features", "megatorn", "--name", "r"]) == P.REFUSED
    err = capsys.readouterr().err
    assert "--features 'megatorn': unknown 'megatorn'" in err and "megatron" in err


def test_launch_without_a_command_is_refused(capsys):
    assert P.main(["launch", "--features", "fsdp", "--dry-run", "--name", "r"]) == P.REFUSED
    assert "needs the verl command after `--`" in capsys.readouterr().err
    assert P.main(["launch", "--features", "fsdp", "--dry-run", "--name", "r", "--"]) == P.REFUSED


def test_lint_of_an_empty_input_is_not_ok(tmp_path, capsys):
    import importlib.util as iu

    spec = iu.spec_from_file_location("lint_overrides_cli", os.path.join(
        os.path.dirname(__file__), "..", "verl_examples", "lint_overrides.py"))
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert mod.main([str(empty)]) == 1
    out = capsys.readouterr().out
    assert "no verl command" in out and not out.startswith("ok")


@pytest.mark.parametrize("value, true", [(True, True), (1, True), ("1", True), ("True", True), ("true", True),
                                         (2.0, True), (False, False), (0, False), ("0", False), ("0.0", False),
                                         ("False", False), (None, False), ("null", False)])
def test_booleans_are_read_as_verl_reads_them(value, true):
    from npu_flashrl.values import is_true

    assert is_true(value) is true


def test_use_mbridge_1_is_true_as_verl_reads_it():
    """Hydra types use_mbridge=1 as the int 1, which verl's engine takes as true: not refused."""
    meg = "actor_rollout_ref.actor.megatron."
    words = [*MAIN, "--config-name=ppo_megatron_trainer", "actor_rollout_ref.actor.strategy=megatron",
             f"{meg}tensor_model_parallel_size=1"]
    assert problems([*words, f"{meg}use_mbridge=1"], features=("megatron",)) == []
    one([*words, f"{meg}use_mbridge=0"], ["use_mbridge"], features=("megatron",))
