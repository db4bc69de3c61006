"""Issue 37's CLI leftovers: each bad input is a named error (naming the flag, variable or file and
what was expected) or a correct acceptance; `verify --json` prints JSON in every outcome.

CLI cases run the real `python -m npu_flashrl.cli` in a subprocess on the CPU stack.

Stand-ins, by name:
* a broken torch_npu: a `torch_npu` package on PYTHONPATH whose import raises ImportError (as a
  torch_npu without CANN's libascendcl.so does);
* `verify --kernels --strict` on an op that accepts an invalid input: `kernels.conformance.run` is
  replaced by one returning such a row (the emulation refuses every invalid case, as it must, so
  only a device could produce that row);
* "read-only" files: tests run as root here and root ignores file modes, so those subprocesses drop
  CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH from their capability bounding set (`cli_env.drop_dac`).
"""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from cli_env import broken_torch_npu, can_drop_dac, cli_env, drop_dac

from npu_flashrl import cli

ROOT = Path(__file__).resolve().parents[2]


def npu_flashrl(*args, env: Optional[dict] = None, no_dac: bool = False, cwd=None):
    preexec = drop_dac if (no_dac and os.geteuid() == 0) else None
    return subprocess.run([sys.executable, "-m", "npu_flashrl.cli", *map(str, args)], env=env or cli_env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=preexec, cwd=cwd)


# ------------------------------------------------------------------------------ verify --kernels

@pytest.mark.parametrize("extra,named", [
    (["--config", "c.yaml"], "--config"),
    (["--verl-overrides", "-"], "--verl-overrides"),
    (["--apply-patches"], "--apply-patches"),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_verify_kernels_refuses_flags_it_does_not_read(extra, named, as_json, capsys):
    argv = ["verify", "--kernels", *extra] + (["--json"] if as_json else [])
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert named in err and "--kernels" in err and "does not read" in err, err
    if as_json:
        doc = json.loads(out)
        assert doc["ok"] is False and named in doc["error"]
    else:
        assert out == ""


def test_verify_kernels_strict_fails_an_op_that_accepts_invalid_input(monkeypatch, capsys):
    from npu_flashrl.kernels import conformance

    row = {"op": "npu_quantize", "status": conformance.ACCEPTS_INVALID, "detail": "x", "device": "npu"}
    monkeypatch.setattr(conformance, "run", lambda cases=None: [dict(row)])
    assert cli.main(["verify", "--kernels", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert cli.main(["verify", "--kernels", "--json", "--strict"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["strict"] is True


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_kernels_broken_torch_npu_is_a_fail_row(tmp_path, as_json):
    env = cli_env(PYTHONPATH=os.pathsep.join([broken_torch_npu(tmp_path), str(ROOT)]))
    res = npu_flashrl("verify", "--kernels", *(["--json"] if as_json else []), env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    if as_json:
        doc = json.loads(res.stdout)
        assert doc["ok"] is False
        (row,) = doc["rows"]
        assert row["status"] == "FAIL" and "libascendcl.so" in row["detail"] and "torch_npu" in row["fix"]
    else:
        assert "`import torch_npu` fails" in res.stdout and "fix: reinstall the pinned torch_npu" in res.stdout


# ------------------------------------------------------------------------- environment switches

@pytest.mark.parametrize("value", ["maybe", "2", "enable"])
def test_yield_flashrl_unknown_word_is_refused_by_name(value, monkeypatch):
    from npu_flashrl.adapters import flashrl
    from npu_flashrl.values import SwitchError

    monkeypatch.setenv(flashrl.YIELD_ENV, value)
    with pytest.raises(SwitchError, match=rf"NPU_FLASHRL_YIELD_FLASHRL='{value}': expected 1 or 0"):
        flashrl.should_yield()


@pytest.mark.parametrize("value,want", [("1", True), ("Yes", True), ("off", False), ("FALSE", False)])
def test_yield_flashrl_spellings(value, want, monkeypatch):
    from npu_flashrl.adapters import flashrl

    monkeypatch.setenv(flashrl.YIELD_ENV, value)
    assert flashrl.should_yield() is want


def test_verify_names_bad_switches():
    res = npu_flashrl("verify", "--json", env=cli_env(NPU_FLASHRL_YIELD_FLASHRL="maybe",
                                                   NPU_FLASHRL_MISMATCH_WARN="inf"))
    doc = json.loads(res.stdout)
    rows = {r["check"]: r for r in doc["rows"]}
    assert res.returncode == 1 and doc["ok"] is False
    assert rows["NPU_FLASHRL_YIELD_FLASHRL"]["status"] == "FAIL"
    assert "'maybe'" in rows["NPU_FLASHRL_YIELD_FLASHRL"]["detail"]
    assert rows["NPU_FLASHRL_MISMATCH_WARN"]["status"] == "warn"
    assert "'inf'" in rows["NPU_FLASHRL_MISMATCH_WARN"]["detail"]


@pytest.mark.parametrize("value", ["inf", "Infinity", "nan", "-1", "0"])
def test_mismatch_warn_not_finite_positive_warns_by_name(value, monkeypatch, caplog):
    from npu_flashrl.adapters import verl as verl_adapter

    monkeypatch.setenv(verl_adapter.WARN_ENV, value)
    with caplog.at_level(logging.WARNING, logger="npu_flashrl"):
        assert verl_adapter.warn_threshold() == verl_adapter.DEFAULT_WARN_THRESHOLD
    assert f"NPU_FLASHRL_MISMATCH_WARN={value!r}" in caplog.text


def test_mismatch_warn_finite_value_is_kept(monkeypatch):
    from npu_flashrl.adapters import verl as verl_adapter

    monkeypatch.setenv(verl_adapter.WARN_ENV, "1.5")
    assert verl_adapter.warn_threshold() == 1.5


# ------------------------------------------------------------------------------ setup -o read-only

@pytest.mark.skipif(not can_drop_dac(), reason="cannot drop CAP_DAC_OVERRIDE as root here: file modes "
                                               "cannot be tested")
@pytest.mark.parametrize("extra", [[], ["-a"], ["--force"]])
def test_setup_refuses_to_replace_a_read_only_config(tmp_path, extra):
    cfg = tmp_path / "flashrl.yaml"
    first = npu_flashrl("setup", "--fn", "bf16", "-o", cfg)
    assert first.returncode == 0, first.stderr
    os.chmod(cfg, 0o444)
    before = (cfg.read_bytes(), os.stat(cfg).st_mtime_ns, os.stat(cfg).st_ino)
    res = npu_flashrl("setup", "--fn", "bf16", *extra, "-o", cfg, no_dac=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{cfg}: exists and is read-only (mode 0444)" in res.stderr and "chmod u+w" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert (cfg.read_bytes(), os.stat(cfg).st_mtime_ns, os.stat(cfg).st_ino) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flashrl.yaml"]


# ------------------------------------------------------------------ install_pinned.sh, lint --verl-dir

INSTALL = ROOT / "scripts" / "install_pinned.sh"
LINT = ROOT / "tests" / "verl_examples" / "lint_overrides.py"


@pytest.mark.parametrize("flag", ["--workdir", "--log", "--line", "--only"])
def test_install_pinned_refuses_an_empty_equals_value(tmp_path, flag):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_REPO_URL")}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", PYTHON=sys.executable, MIN_FREE_GB="0",
               ASCEND_HOME=str(tmp_path / "Ascend"), HOME=str(tmp_path))
    res = subprocess.run(["bash", str(INSTALL), "--dry-run", f"{flag}="], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{flag}= needs a value" in res.stderr, res.stderr
    assert " /verl" not in res.stdout and "clone" not in res.stdout.lower()  # nothing planned
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["missing", "not_a_verl_tree"])
def test_lint_overrides_names_a_bad_verl_dir(tmp_path, name):
    verl_dir = tmp_path / "verl-src"
    if name == "not_a_verl_tree":
        verl_dir.mkdir()
    res = subprocess.run([sys.executable, str(LINT), "--verl-dir", str(verl_dir)], env=cli_env(),
                         input="python3 -m verl.trainer.main_ppo trainer.total_epochs=1\n",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"--verl-dir {verl_dir}:" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert ("no such directory" if name == "missing" else "trainer/config") in res.stderr


def test_lint_overrides_accepts_the_installed_verl_package_as_verl_dir():
    verl = pytest.importorskip("verl")
    res = subprocess.run([sys.executable, str(LINT), "--verl-dir", os.path.dirname(verl.__file__)], env=cli_env(),
                         input="python3 -m verl.trainer.main_ppo trainer.total_epochs=1\n",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("ok: 1 overrides"), res.stdout + res.stderr


# ------------------------------------------------------------------------ the rest of the last set

def test_deeply_nested_yaml_is_a_named_config_error(tmp_path):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("configs:\n  - " + "[" * 5000 + "]" * 5000 + "\n")
    res = npu_flashrl("verify", "--json", "--config", cfg)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    rows = [r for r in json.loads(res.stdout)["rows"] if r["status"] == "FAIL"]
    assert any(str(cfg) in r["detail"] and "nested too deeply" in r["detail"] for r in rows), rows


def test_logging_file_that_cannot_be_written_falls_back_to_stderr_once():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    res = npu_flashrl("verify", env=cli_env(FLASHRL_LOGGING_FILE="/dev/full", FLASHRL_CONFIG="bf16"))
    assert "--- Logging error ---" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("FLASHRL_LOGGING_FILE='/dev/full': cannot write to it") == 1, res.stderr
    assert "Using the profile-free default config for bf16" in res.stderr  # the record that failed, kept


@pytest.mark.parametrize("seed", [str(2**31), str(10**30), "-1"])
def test_rehearse_seed_out_of_range_is_a_usage_error(seed):
    res = npu_flashrl("rehearse", "--seed", seed)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "argument --seed" in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("kind", ["loop", "dangling"])
def test_output_dir_through_an_unresolvable_symlink_is_refused_up_front(tmp_path, kind):
    if kind == "loop":
        os.symlink(tmp_path / "b", tmp_path / "a")
        os.symlink(tmp_path / "a", tmp_path / "b")
    else:
        os.symlink(tmp_path / "nowhere", tmp_path / "a")
    res = npu_flashrl("rehearse", "--output-dir", tmp_path / "a")
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert f"--output-dir {tmp_path / 'a'}" in res.stderr and "symlink that does not resolve" in res.stderr
    res = npu_flashrl("setup", "--fn", "bf16", "-o", tmp_path / "a" / "c.yaml")
    assert res.returncode == 1 and "symlink that does not resolve" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] + (["b"] if kind == "loop" else [])
