"""Bad input to the shell scripts: every numeric or boolean variable is
checked by pattern before any arithmetic, a failed check stops the run whatever happens inside the
check, and paths with non-ASCII or Hydra-special characters reach verl as the same strings.

Each case asserts the exit code, that the message names the variable and its value, and that no
watched file changed or appeared (the helpers of test_bad_input.py).

Stand-ins, by name:
* install_pinned.sh's interpreter is a wrapper around this test's Python that records and skips
  `-m pip` (a real run must not install anything here); `df` is a script printing garbage when a
  test needs a check to break inside the checks function;
* the recipes' `npu-flashrl` and `python` are scripts that only record that they were started;
* verl's command line parser is Hydra's own `OverridesParser` (hydra-core, what verl's main_ppo
  parses its overrides with), run on the words a shell makes of the dry run's output.
"""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from test_bad_input import (FSDP_CONFIG, FSDP_INT8, INSTALL, MEGATRON_CONFIG, RECIPES, ROOT, Case,
                            _install_env, bash_runner, check, d, recipe, run)  # noqa: F401 (fixtures)

FSDP_CONFIG_09 = RECIPES / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh"
FSDP_INT8_09 = RECIPES / "flash_rl" / "grpo_qwen25_7b_fsdp_int8_A2_verl09.sh"
DOCKER_RUN = ROOT / "docker" / "run.sh"
PREPARE_DATA = RECIPES / "data" / "prepare_data.sh"
INJECTION = "HOME[$(touch {marker})]"


# ================================================================================== install_pinned.sh

def _fake_python(tmp_path) -> Path:
    """This Python, except that `-m pip ...` is recorded in `pip_calls` and does nothing."""
    calls = tmp_path / "pip_calls"
    fake = tmp_path / "fakebin" / "python3"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> {calls}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


INSTALL_VAR_CASES = {
    # name: (env, extra args, needles)
    "min_free_gb_command_substitution": ({"MIN_FREE_GB": INJECTION}, ["--dry-run"], ["MIN_FREE_GB", "HOME[$(touch"]),
    "min_free_gb_with_unit": ({"MIN_FREE_GB": "60GB"}, [], ["MIN_FREE_GB", "'60GB'"]),
    "min_free_gb_negative": ({"MIN_FREE_GB": "-5"}, ["--dry-run"], ["MIN_FREE_GB", "'-5'"]),
    "min_free_gb_huge": ({"MIN_FREE_GB": "99999999999999999999"}, ["--dry-run"], ["MIN_FREE_GB"]),
    "max_jobs_word": ({"MAX_JOBS": "lots"}, ["--dry-run"], ["MAX_JOBS", "'lots'"]),
    "max_jobs_injection": ({"MAX_JOBS": INJECTION}, [], ["MAX_JOBS"]),
    "skip_npu_check_yes": ({"SKIP_NPU_CHECK": "yes"}, [], ["SKIP_NPU_CHECK", "'yes'", "0 or 1"]),
    "allow_mismatch_true": ({"ALLOW_MISMATCH": "true"}, [], ["ALLOW_MISMATCH", "'true'"]),
    "python_missing": ({"PYTHON": "/nonexistent/python3"}, ["--dry-run"], ["PYTHON=/nonexistent/python3"]),
}


@pytest.mark.parametrize("name", sorted(INSTALL_VAR_CASES))
def test_install_pinned_refuses_bad_variables(d, name):
    extra, args, needles = INSTALL_VAR_CASES[name]
    marker = d / "injected"
    extra = {k: v.replace("{marker}", str(marker)) for k, v in extra.items()}
    env = _install_env(d, **{"PYTHON": str(_fake_python(d)), "SKIP_NPU_CHECK": "1", "ALLOW_MISMATCH": "1", **extra})
    text = check(Case([INSTALL, *args, "--only", "npu_flashrl", "--no-verify", "--workdir", d / "wd"], 1,
                      needles, [d / "wd", marker, d / "pip_calls"], env=env), bash_runner)
    assert "done" not in text.splitlines()[-1]
    assert not marker.exists(), "a variable's value was run as a command"


def test_install_pinned_check_broken_inside_the_checks_stops_the_run(d):
    """`df` gives garbage: whatever breaks inside the checks function, a real run installs nothing."""
    bin_dir = d / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "df").write_text("#!/bin/sh\necho 'Filesystem 1K-blocks Used Available'\necho 'x 1 2 12abc 4'\n")
    (bin_dir / "df").chmod(0o755)
    env = _install_env(d, PYTHON=str(_fake_python(d)), SKIP_NPU_CHECK="1", ALLOW_MISMATCH="1", MIN_FREE_GB="1")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    text = check(Case([INSTALL, "--only", "npu_flashrl", "--no-verify", "--workdir", d / "wd"], 1,
                      ["cannot read the free space", "12abc", "nothing was installed"], [d / "pip_calls"],
                      env=env), bash_runner)
    assert "] done" not in text


def test_install_pinned_good_variables_still_run(d):
    """The same stand-ins with good values: the run gets to the (recorded) pip install and says done."""
    env = _install_env(d, PYTHON=str(_fake_python(d)), SKIP_NPU_CHECK="1", ALLOW_MISMATCH="1", MIN_FREE_GB="0",
                       MAX_JOBS="4")
    proc = run(["bash", str(INSTALL), "--only", "npu_flashrl", "--no-verify", "--workdir", str(d / "wd")], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-e " + str(ROOT) in (d / "pip_calls").read_text()


# ================================================================================== docker, data

@pytest.mark.parametrize("var, value", [("NPU_DEVICES", "0,../sda"), ("NPU_DEVICES", "0,,1"),
                                        ("SHM_SIZE", "lots"), ("SHM_SIZE", "500gb")])
def test_docker_run_refuses_bad_variables(d, var, value):
    env = dict(os.environ, DOCKER=str(d / "no-docker"), **{var: value})
    check(Case([DOCKER_RUN, "--dry-run"], 1, [var, repr(value)], [d], env=env), bash_runner)


def test_prepare_data_refuses_bad_overwrite(d):
    env = dict(os.environ, OVERWRITE="maybe", DATA_ROOT=str(d / "data"), VERL_DIR=str(d))
    check(Case([PREPARE_DATA, "--dry-run"], 1, ["OVERWRITE", "'maybe'"], [d], env=env), bash_runner)


# ================================================================================== recipe preflight

RECIPE_VAR_CASES = {
    # name: (script, env, needles)
    "tis_threshold_word": (FSDP_CONFIG, {"TIS_THRESHOLD": "abc"}, ["TIS_THRESHOLD", "'abc'"]),
    "tis_threshold_negative": (FSDP_CONFIG, {"TIS_THRESHOLD": "-1"}, ["TIS_THRESHOLD", "'-1'"]),
    "tis_threshold_zero": (FSDP_CONFIG, {"TIS_THRESHOLD": "0"}, ["TIS_THRESHOLD", "> 0", "'0'"]),
    "dynamic_bsz_maybe": (FSDP_CONFIG, {"USE_DYNAMIC_BSZ": "maybe"}, ["USE_DYNAMIC_BSZ", "'maybe'"]),
    "lmhead_fp32_maybe": (FSDP_CONFIG, {"FLASHRL_LMHEAD_FP32": "maybe"}, ["FLASHRL_LMHEAD_FP32", "'maybe'"]),
    "entry_lmhead_fp32_maybe": (FSDP_INT8, {"FLASHRL_LMHEAD_FP32": "maybe"}, ["FLASHRL_LMHEAD_FP32", "'maybe'"]),
    "enforce_eager_word": (FSDP_CONFIG, {"ENFORCE_EAGER": "sometimes"}, ["ENFORCE_EAGER", "'sometimes'"]),
    "megatron_offload_word": (MEGATRON_CONFIG, {"ACTOR_OFFLOAD": "yes please"}, ["ACTOR_OFFLOAD"]),
    "rollout_tp_not_dividing": (FSDP_CONFIG, {"ROLLOUT_TP": "3"}, ["ROLLOUT_TP=3", "NPUS_PER_NODE=8", "divide"]),
    "train_batch_below_mini_batch": (FSDP_CONFIG, {"TRAIN_BATCH_SIZE": "4", "PPO_MINI_BATCH_SIZE": "8"},
                                     ["TRAIN_BATCH_SIZE=4", "PPO_MINI_BATCH_SIZE=8"]),
    "bucket_overflow": (FSDP_CONFIG_09, {"UPDATE_WEIGHTS_BUCKET_MB": "99999999999999999999"},
                        ["UPDATE_WEIGHTS_BUCKET_MB", "'99999999999999999999'"]),
    "bucket_above_range": (FSDP_CONFIG_09, {"UPDATE_WEIGHTS_BUCKET_MB": "2000000"}, ["UPDATE_WEIGHTS_BUCKET_MB", "1048576"]),
    "nnodes_overflow": (FSDP_CONFIG, {"NNODES": "9223372036854775808"}, ["NNODES", "'9223372036854775808'"]),
    "npus_injection": (FSDP_INT8, {"NPUS_PER_NODE": INJECTION}, ["NPUS_PER_NODE"]),
    "megatron_tp_overflow": (MEGATRON_CONFIG, {"TRAIN_TP": "4294967296", "TRAIN_PP": "4294967296"}, ["TRAIN_TP"]),
}


@pytest.mark.parametrize("name", sorted(RECIPE_VAR_CASES))
def test_recipe_preflight_refuses_bad_values(recipe, name):
    script, extra, needles = RECIPE_VAR_CASES[name]
    marker = recipe["tmp"] / "injected"
    env = dict(recipe["env"], FLASHRL_CONFIG=str(recipe["tmp"] / "flashrl.yaml"),
               **{k: v.replace("{marker}", str(marker)) for k, v in extra.items()})
    (recipe["tmp"] / "flashrl.yaml").write_text("configs:\n- fn: bf16\n")
    for args in ([], ["--dry-run"]):  # the dry run checks as much as the real run
        check(Case([script, *args], 1, needles, [recipe["tmp"] / "models", recipe["marker"], recipe["run"], marker],
                   env=env), bash_runner)
    assert not marker.exists()


# ================================================================================== Hydra quoting

hydra_parser = pytest.importorskip("hydra.core.override_parser.overrides_parser")

AWKWARD = ["/data/模型/Qwen", "/d/a (copy)/x=1#2/[v]{w}/~u&v/it's", "/d/sp ace/\"dq\"/back\\slash\\",
           "/d/comma,colon:semi;/$HOME/end\\", "null", "1e5", "True", "plain_name-1.2", "/plain/path.parquet"]


def _bash(code: str, *args: str) -> str:
    proc = subprocess.run(["bash", "-c", f"set -euo pipefail; source {shlex.quote(str(RECIPES / 'common.sh'))}; {code}",
                           "bash", *args], capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("value", AWKWARD)
def test_hydra_quoting_reads_back_the_same_string(value):
    """common.sh's hydra_value / hydra_str give overrides that Hydra's parser reads back as `value`."""
    parser = hydra_parser.OverridesParser.create()
    for fn in ("hydra_value", "hydra_str"):
        override = "a.b=" + _bash(f'{fn} "$1"', value)
        parsed = parser.parse_overrides([override])[0]
        assert parsed.value() == value, (fn, override, parsed.value())
        assert isinstance(parsed.value(), str)
    plain = _bash('hydra_value "$1"', "/plain/path.parquet")
    assert plain == "/plain/path.parquet", "plain paths stay unquoted"


def _dry_run_words(stdout: str):
    """The verl launch's argv as a POSIX shell makes it of the printed command."""
    text = stdout[stdout.index("env \\"):]
    proc = subprocess.run(["sh", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "sh", text.replace("\\\n", " ")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split("\0")[:-1]
    assert words == shlex.split(text.replace("\\\n", " ")), "Python's shlex reads the dry run differently"
    return words


@pytest.mark.parametrize("script", [FSDP_INT8, FSDP_INT8_09])
@pytest.mark.parametrize("where", ["chinese", "hydra_special"])
def test_awkward_paths_reach_verl_unchanged_through_the_dry_run(recipe, script, where):
    """MODEL_PATH, the data files and RUN_DIR (hence FLASHRL_CONFIG) with non-ASCII or Hydra-special
    characters: the dry run's overrides parse with Hydra's own parser and give the same paths."""
    name = "模型" if where == "chinese" else "a (b)=c#d [e]{f}~g&h'i"
    tmp = recipe["tmp"] / name
    model = tmp / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    data = tmp / "数据 data"
    data.mkdir()
    for f in ("train.parquet", "test.parquet"):
        (data / f).write_bytes(b"")
    run_dir = tmp / "run"
    env = dict(recipe["env"], MODEL_PATH=str(model), DATA_DIR=str(data), RUN_DIR=str(run_dir), FLASHRL_FN="int8_profile_free",
               LC_ALL="C")
    env.pop("ROLLOUT_PRECISION")
    env.pop("VLLM_PLUGINS", None)
    env.pop("VLLM_ASCEND_ENABLE_NZ", None)
    proc = run(["bash", str(script), "--dry-run"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    words = _dry_run_words(proc.stdout)
    entry = words.index("verl.trainer.main_ppo")
    env_words = dict(w.split("=", 1) for w in words[1:entry - 2])
    overrides = [w for w in words[entry + 1:] if not w.startswith("--")]
    parsed = {o.key_or_group if not o.is_add() else "+" + o.key_or_group: o.value()
              for o in hydra_parser.OverridesParser.create().parse_overrides(overrides)}
    config = str(run_dir / "configs" / "Qwen2.5-7B-Instruct.int8_profile_free.yaml")
    assert parsed["actor_rollout_ref.model.path"] == str(model)
    assert parsed["data.train_files"] == str(data / "train.parquet")
    assert parsed["data.val_files"] == str(data / "test.parquet")
    assert parsed["+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG"] == config
    assert env_words["FLASHRL_CONFIG"] == config
    setup = [shlex.split(line) for line in proc.stdout.splitlines() if " setup " in line]
    assert len(setup) == 1 and setup[0][setup[0].index("-o") + 1] == config, setup
    assert setup[0][setup[0].index("-m") + 1] == str(model)
    assert not run_dir.exists(), "a dry run creates nothing"
