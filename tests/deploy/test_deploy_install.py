"""scripts/install_pinned.sh and npu_flashrl.pins: pins read from one file, dry run, checks, idempotency.

Nothing here installs anything: every run is a --dry-run, or a real run that must stop at its checks.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_pinned.sh"
sys.path.insert(0, str(ROOT))
from npu_flashrl import pins as pins_mod  # noqa: E402

PINS = pins_mod.load_pins()
CURRENT = pins_mod.load_pins(line="current")


def one_line_copy(line="pinned"):
    """A line's pins as a fresh dict, to change and write to another pins file."""
    return copy.deepcopy(pins_mod.load_pins(line=line))


def base_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_REPO_URL")}
    env.pop("NPU_FLASHRL_PINS", None)
    # a PATH without npu-smi; the test interpreter (with pyyaml) first
    env["PATH"] = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    env["PYTHON"] = sys.executable
    env["MIN_FREE_GB"] = "0"
    env["ASCEND_HOME"] = str(tmp_path / "Ascend")
    env.update(extra)
    return env


def install(tmp_path, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), "--workdir", str(tmp_path / "wd"), *args],
                          env=base_env(tmp_path, **env), capture_output=True, text=True, timeout=120)


def steps(out):
    return [line for line in out.splitlines() if line.startswith("+")]


# ------------------------------------------------------------------------------------------- pins.py
def test_load_pins_has_the_pinned_stack():
    assert PINS["python"] == "3.10" and PINS["cann"] == "8.2.RC3"
    p = PINS["packages"]
    assert p["vllm"]["commit"] == "e03940762b43812fccd3c214bda60201cff9d16a"
    assert p["vllm_ascend"]["commit"] == "7e16b4a7cdb15723c63c1c0efe58672a056eace8"
    assert p["verl"]["commit"] == "51d2104ecb61563c41123a8f0bce2f06b18387dc"
    assert p["mindspeed"]["commit"] == "1cdd0abd75e40936ad31721c092f57c695dd72c4"
    assert p["megatron_core"]["ref"] == "core_v0.12.1"
    assert p["transformers"]["commit"] == "8365f70e925"
    assert p["torch"]["version"] == p["torch_npu"]["version"] == "2.7.1"
    assert p["flash_llm_rl"]["version"] == "1.0.3"


def test_pins_cli_get_sh_and_env_override(tmp_path):
    out = subprocess.run([sys.executable, "-m", "npu_flashrl.pins", "get", "packages.vllm.commit"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == PINS["packages"]["vllm"]["commit"]
    missing = subprocess.run([sys.executable, str(ROOT / "npu_flashrl" / "pins.py"), "get", "packages.nope"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "packages.nope" in missing.stderr
    sh = pins_mod.shell_assignments()
    assert f"PIN_PACKAGES_VERL_COMMIT={PINS['packages']['verl']['commit']}" in sh
    other = tmp_path / "pins.yaml"
    data = one_line_copy()  # written back in the one-line layout (still read as line pinned)
    data["packages"]["verl"]["commit"] = "f" * 40
    other.write_text(yaml.safe_dump(data))
    env = dict(os.environ, NPU_FLASHRL_PINS=str(other))
    out = subprocess.run([sys.executable, str(ROOT / "npu_flashrl" / "pins.py"), "get", "packages.verl.commit"],
                         env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "f" * 40
    with pytest.raises(FileNotFoundError, match="nowhere"):
        pins_mod.load_pins(tmp_path / "nowhere.yaml")


# ------------------------------------------------------------------------------------------- dry run
def test_dry_run_prints_every_step_with_the_pinned_commits(tmp_path):
    proc = install(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    p = PINS["packages"]
    lines = steps(out)
    for name in ["vllm", "vllm_ascend", "mindspeed", "verl", "transformers"]:
        commit = p[name]["commit"]
        assert f"+ git -C {tmp_path / 'wd' / name} checkout --detach {commit}" in lines, name
        assert f"+ git clone --filter=blob:none {p[name]['repo']} {tmp_path / 'wd' / name}" in lines, name
    assert f"+ git -C {tmp_path / 'wd' / 'megatron_core'} checkout --detach {p['megatron_core']['ref']}" in lines
    text = "\n".join(lines)
    assert "env VLLM_TARGET_DEVICE=empty" in text
    assert "env COMPILE_CUSTOM_KERNELS=1 SOC_VERSION=ascend910b1" in text
    assert "requirements-npu.txt" in text
    assert f"flash-llm-rl" in out  # installed or skipped, always reported
    assert lines[-1].endswith("npu-flashrl verify")
    assert not (tmp_path / "wd").exists(), "a dry run must not create the workdir"
    # ordering: torch before the sources, transformers after verl, npu_flashrl last before verify
    idx = {k: text.index(k) for k in ["torch==", "vllm.git", "verl.git", "transformers.git", f"-e {ROOT}"]}
    assert idx["torch=="] < idx["vllm.git"] < idx["verl.git"] < idx["transformers.git"] < idx[f"-e {ROOT}"]


def test_dry_run_reports_failed_checks_and_a_real_run_stops_before_installing(tmp_path):
    dry = install(tmp_path, "--dry-run")
    assert "npu-smi not found" in dry.stdout
    assert "ascend_toolkit_install.info" in dry.stdout  # names the file it looked for
    assert "a real run would stop here" in dry.stdout
    real = install(tmp_path)
    assert real.returncode != 0
    assert "check(s) failed, nothing was installed" in real.stdout + real.stderr
    assert "npu-smi not found" in real.stdout
    assert not steps(real.stdout), "no install step may run after a failed check"
    log = tmp_path / "wd" / "install_pinned.log"
    assert log.exists() and "npu-smi not found" in log.read_text()


def test_checks_pass_with_cann_and_npu_smi(tmp_path):
    info = tmp_path / "ascend_toolkit_install.info"
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={PINS['cann']}\n")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "npu-smi").write_text("#!/bin/sh\necho fake\n")
    (fake_bin / "npu-smi").chmod(0o755)
    env = base_env(tmp_path, CANN_VERSION_FILE=str(info))
    env["PATH"] = f"{fake_bin}:{env['PATH']}"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--allow-mismatch", "--workdir", str(tmp_path / "wd")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0
    assert f"ok: CANN {PINS['cann']}" in proc.stdout and "ok: npu-smi" in proc.stdout
    assert "a real run would stop here" not in proc.stdout
    info.write_text("version=8.0.RC1\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--workdir", str(tmp_path / "wd")],
                          env=env, capture_output=True, text=True)
    assert f"CANN 8.0.RC1 in {info}, the pinned stack needs CANN {PINS['cann']}" in proc.stdout


def test_changing_a_pin_changes_the_printed_commit(tmp_path):
    data = one_line_copy()  # written back in the one-line layout (still read as line pinned)
    new = "0123456789abcdef0123456789abcdef01234567"
    data["packages"]["vllm_ascend"]["commit"] = new
    data["packages"]["vllm"]["env"]["VLLM_TARGET_DEVICE"] = "other"
    other = tmp_path / "pins.yaml"
    other.write_text(yaml.safe_dump(data))
    proc = install(tmp_path, "--dry-run", NPU_FLASHRL_PINS=str(other))
    assert proc.returncode == 0, proc.stderr
    assert f"checkout --detach {new}" in proc.stdout
    assert PINS["packages"]["vllm_ascend"]["commit"] not in proc.stdout
    assert "env VLLM_TARGET_DEVICE=other" in proc.stdout


def test_clone_urls_are_overridable(tmp_path):
    proc = install(tmp_path, "--dry-run", VERL_REPO_URL="https://mirror.example/verl.git",
                   MINDSPEED_REPO_URL="https://mirror.example/MindSpeed.git")
    assert f"+ git clone --filter=blob:none https://mirror.example/verl.git {tmp_path / 'wd' / 'verl'}" in proc.stdout
    assert f"+ git clone --filter=blob:none https://mirror.example/MindSpeed.git {tmp_path / 'wd' / 'mindspeed'}" in proc.stdout


def test_only_and_no_verify(tmp_path):
    proc = install(tmp_path, "--dry-run", "--only", "verl", "--no-verify")
    lines = steps(proc.stdout)
    assert any("verl.git" in s for s in lines)
    assert not any("vllm.git" in s or "transformers.git" in s for s in lines)
    assert not any(s.endswith("verify") for s in lines)


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


def test_idempotent_skip_at_pin_and_reinstall_at_wrong_commit(tmp_path):
    import importlib.metadata

    try:  # the distribution must be installed for "already at its pin" (metadata only, no import)
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("verl is not installed in this interpreter (the CPU stack installs verl 0.6.1)")
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    git("init", "-q", cwd=upstream)
    (upstream / "a").write_text("1")
    git("add", "a", cwd=upstream)
    git("commit", "-q", "-m", "one", cwd=upstream)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=upstream, capture_output=True, text=True).stdout.strip()
    (upstream / "a").write_text("2")
    git("commit", "-q", "-am", "two", cwd=upstream)
    second = subprocess.run(["git", "rev-parse", "HEAD"], cwd=upstream, capture_output=True, text=True).stdout.strip()
    wd = tmp_path / "wd"
    git("clone", "-q", str(upstream), str(wd / "verl"), cwd=tmp_path)
    git("checkout", "-q", "--detach", first, cwd=wd / "verl")
    (wd / ".installed").mkdir(parents=True)
    (wd / ".installed" / "verl").write_text(first + "\n")

    data = one_line_copy()  # written back in the one-line layout (still read as line pinned)
    data["packages"]["verl"]["commit"] = first
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump(data))
    proc = install(tmp_path, "--dry-run", "--only", "verl", "--no-verify", NPU_FLASHRL_PINS=str(pins_file),
                   VERL_REPO_URL=str(upstream))
    assert f"skip: verl already at {first}" in proc.stdout
    assert not any("verl" in s for s in steps(proc.stdout))

    data["packages"]["verl"]["commit"] = second  # the pin moved: the checkout is now at the wrong commit
    pins_file.write_text(yaml.safe_dump(data))
    proc = install(tmp_path, "--dry-run", "--only", "verl", "--no-verify", NPU_FLASHRL_PINS=str(pins_file),
                   VERL_REPO_URL=str(upstream))
    lines = steps(proc.stdout)
    assert f"+ git -C {wd / 'verl'} checkout --detach {second}" in lines
    assert any("requirements-npu.txt" in s for s in lines)
    assert not any(s.startswith(f"+ git clone") for s in lines), "an existing checkout is reused"

    # checkout moved by hand while the stamp says "first": re-installed too
    data["packages"]["verl"]["commit"] = first
    pins_file.write_text(yaml.safe_dump(data))
    git("checkout", "-q", "--detach", second, cwd=wd / "verl")
    proc = install(tmp_path, "--dry-run", "--only", "verl", "--no-verify", NPU_FLASHRL_PINS=str(pins_file),
                   VERL_REPO_URL=str(upstream))
    assert f"+ git -C {wd / 'verl'} checkout --detach {first}" in steps(proc.stdout)


def test_help_and_bad_argument(tmp_path):
    h = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert h.returncode == 0 and "--dry-run" in h.stdout and "NPU_FLASHRL_PINS" in h.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--bogus" in bad.stderr


# ------------------------------------------------------------------------------------------- lines
def raw_line(name):
    """A line as the YAML file says it, read without npu_flashrl.pins (an independent reading)."""
    return yaml.safe_load((ROOT / "npu_flashrl" / "pins.yaml").read_text())["lines"][name]


def raw_assignments(node, prefix="PIN"):
    """PIN_<PATH> -> str(value) for every scalar, computed here, not by pins.py."""
    out = {}
    for k, v in node.items():
        name = f"{prefix}_{''.join(c if c.isalnum() else '_' for c in str(k)).upper()}"
        if isinstance(v, dict):
            out.update(raw_assignments(v, name))
        else:
            out[name] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return out


def test_pins_file_has_both_lines_and_the_pinned_one_is_the_default():
    assert pins_mod.line_names() == ["pinned", "current"]
    assert PINS == raw_line("pinned")  # no line given: pinned, exactly as before
    p = CURRENT["packages"]
    assert (p["vllm"]["version"], p["vllm"]["ref"]) == ("0.23.0", "v0.23.0")
    assert p["vllm"]["env"] == {"VLLM_TARGET_DEVICE": "empty"}
    assert p["vllm_ascend"]["version"] == "0.23.0" and "commit" not in p["vllm_ascend"]
    assert p["verl"] == {"version": "0.9.1"}
    assert (p["torch"]["version"], p["torch_npu"]["version"]) == ("2.10.0", "2.10.0.post4")
    assert p["transformers"]["version"] == "5.5.4"
    assert p["mindspeed"]["ref"] == p["megatron_core"]["ref"] == "core_r0.16.0"
    assert CURRENT["cann"] == "9.1.0"
    assert CURRENT["docker"] == {"base_image_a2": "quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12",
                                 "base_image_a3": "quay.io/ascend/cann:9.1.0-a3-ubuntu22.04-py3.12"}


def test_pins_cli_line_option_and_errors(tmp_path):
    def cli(*args, **env):
        return subprocess.run([sys.executable, str(ROOT / "npu_flashrl" / "pins.py"), *args],
                              capture_output=True, text=True, env=dict(os.environ, **env))

    assert cli("--line", "current", "get", "packages.vllm.version").stdout.strip() == "0.23.0"
    assert cli("get", "packages.vllm.version").stdout.strip() == "0.10.1"
    assert cli("lines").stdout.split() == ["pinned", "current"]
    bad = cli("--line", "nightly", "get", "python")
    assert bad.returncode == 2 and "unknown line 'nightly'" in bad.stderr and "pinned, current" in bad.stderr
    # the one-line layout (a mirror's old pins file) is still read, as line pinned
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(raw_line("pinned")))
    assert cli("--line", "pinned", "get", "python", NPU_FLASHRL_PINS=str(old)).stdout.strip() == "3.10"
    assert cli("lines", NPU_FLASHRL_PINS=str(old)).stdout.split() == ["pinned"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"default_line": "x", "lines": {"a": {"packages": {}}}}))
    out = cli("get", "python", NPU_FLASHRL_PINS=str(broken))
    assert out.returncode == 2 and "default_line 'x'" in out.stderr and str(broken) in out.stderr


def test_dry_run_current_line_prints_exactly_the_current_pins(tmp_path):
    proc = install(tmp_path, "--dry-run", "--line", "current")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[install_pinned] pin: "):
            key, _, value = line[len("[install_pinned] pin: "):].partition("=")
            printed[key] = value.strip("'")
    assert printed == raw_assignments(raw_line("current"))
    assert "line current" in proc.stdout
    lines, wd = steps(proc.stdout), tmp_path / "wd"
    text = "\n".join(lines)
    p = raw_line("current")["packages"]
    assert f"torch=={p['torch']['version']}" in text and f"torch-npu=={p['torch_npu']['version']}" in text
    assert f"+ git clone --filter=blob:none {p['vllm']['repo']} {wd / 'vllm'}" in lines
    assert f"+ git -C {wd / 'vllm'} checkout --detach {p['vllm']['ref']}" in lines
    assert "requirements/build/cuda.txt" in text and "env VLLM_TARGET_DEVICE=empty" in text

    def release_step(dist, version):
        """The pip step of a release, or None when this interpreter already has it (then skipped)."""
        step = [s for s in lines if s.endswith(f" {dist}=={version}")]
        assert step or f"skip: {dist} already {version}" in proc.stdout, dist
        return step[0] if step else None

    ascend = release_step("vllm-ascend", p["vllm_ascend"]["version"])
    for url in p["vllm_ascend"]["extra_index_urls"].split() if ascend else []:
        assert f"--extra-index-url {url}" in ascend
    for name in ("mindspeed", "megatron_core"):
        assert f"+ git -C {wd / name} checkout --detach {p[name]['ref']}" in lines, name
        assert f"+ git clone --filter=blob:none {p[name]['repo']} {wd / name}" in lines, name
    release_step("verl", p["verl"]["version"])
    release_step("transformers", p["transformers"]["version"])
    assert "requirements-npu.txt" not in text and "verl.git" not in text  # a release, not a checkout
    assert "transformers.git" not in text
    assert f"transformers=={p['transformers']['version']}" in proc.stdout  # constraint (and step, if not there)
    for spec in PINS["packages"].values():  # nothing of the pinned line leaks in
        for field in ("commit", "ref"):
            if field in spec:
                assert str(spec[field]) not in proc.stdout, spec[field]
    assert lines[-1].endswith("npu-flashrl verify")
    assert not (tmp_path / "wd").exists()


def test_unknown_line_and_unknown_component_are_refused(tmp_path):
    for args, env in [(("--line", "nightly"), {}), ((), {"LINE": "nightly"})]:
        proc = install(tmp_path, "--dry-run", *args, **env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "unknown line 'nightly'" in proc.stderr and "pinned current" in proc.stderr
        assert not steps(proc.stdout)
    proc = install(tmp_path, "--dry-run", "--line", "current", "--only", "verl,vllm_ascnd")
    assert proc.returncode == 2 and "unknown component 'vllm_ascnd'" in proc.stderr


def test_branch_ref_is_checked_out_from_origin_and_skipped_when_there(tmp_path):
    """A ref that is a branch of the remote only (MindSpeed / Megatron-LM core_r0.16.0) counts as
    "at its pin" when the checkout is at origin/<branch>. verl stands in for the component (its
    distribution must be installed for the skip; the 0.11 CPU stack has verl 0.6.1)."""
    import importlib.metadata

    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("verl is not installed in this interpreter")
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    git("init", "-q", "-b", "main", cwd=upstream)
    (upstream / "a").write_text("1")
    git("add", "a", cwd=upstream)
    git("commit", "-q", "-m", "one", cwd=upstream)
    git("checkout", "-q", "-b", "core_x", cwd=upstream)
    (upstream / "a").write_text("2")
    git("commit", "-q", "-am", "two", cwd=upstream)
    git("checkout", "-q", "main", cwd=upstream)
    wd = tmp_path / "wd"
    git("clone", "-q", str(upstream), str(wd / "verl"), cwd=tmp_path)
    git("checkout", "-q", "--detach", "origin/core_x", cwd=wd / "verl")
    (wd / ".installed").mkdir(parents=True)
    (wd / ".installed" / "verl").write_text("core_x\n")
    data = one_line_copy("current")
    data["packages"]["verl"] = {"repo": str(upstream), "ref": "core_x"}
    pins_file = tmp_path / "pins.yaml"
    pins_file.write_text(yaml.safe_dump(data))
    proc = install(tmp_path, "--dry-run", "--only", "verl", "--no-verify", NPU_FLASHRL_PINS=str(pins_file))
    assert "skip: verl already at core_x" in proc.stdout, proc.stdout
    git("checkout", "-q", "--detach", "main", cwd=wd / "verl")  # moved off the branch: re-installed
    proc = install(tmp_path, "--dry-run", "--only", "verl", "--no-verify", NPU_FLASHRL_PINS=str(pins_file))
    assert f"+ git -C {wd / 'verl'} checkout --detach core_x" in steps(proc.stdout)


# ------------------------------------------------------------------------------ verify: line match
def fake_site(tmp_path, line_pins, **overrides):
    """A directory of dist-info metadata (no code) for every package of a line, at its pins:
    importlib.metadata finds these first when the directory leads PYTHONPATH."""
    site = tmp_path / "site"
    site.mkdir(parents=True)
    for key, spec in line_pins["packages"].items():
        dist = spec.get("dist") or key.replace("_", "-")
        ref_version = re.search(r"\d+(\.\d+)*", str(spec.get("ref", "0"))).group()  # core_r0.16.0 -> 0.16.0
        version = overrides.get(key) or spec.get("version") or ref_version
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        if "commit" in spec:
            (info / "direct_url.json").write_text(
                '{"url": "file:///src", "vcs_info": {"vcs": "git", "commit_id": "%s"}}' % spec["commit"])
    return site


@pytest.mark.parametrize("line", ["pinned", "current"])
def test_verify_reports_the_line_the_installed_stack_matches(tmp_path, line):
    """The real importlib.metadata lookups of npu_flashrl.pins.match_line and verify's `stack line`
    row, over installed-package metadata made for the test (stand-in: dist-info directories without
    code, since no interpreter here has either production stack)."""
    probe = ("from npu_flashrl import verify; row, used = verify.line_row(); "
             "print(row['status'], used); print(row['detail'])")

    def run(site):
        env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
        match = subprocess.run([sys.executable, "-m", "npu_flashrl.pins", "match"], env=env,
                               capture_output=True, text=True)
        row = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert row.returncode == 0, row.stderr
        return match, row.stdout.splitlines()

    pins = pins_mod.load_pins(line=line)
    match, row = run(fake_site(tmp_path / "ok", pins))
    assert match.returncode == 0 and f"matches line '{line}'" in match.stdout, match.stdout
    assert row[0] == f"ok {line}"

    other = "current" if line == "pinned" else "pinned"
    match, row = run(fake_site(tmp_path / "drift", pins, torch="2.13.0+cpu", vllm_ascend="0.11.0"))
    assert match.returncode == 1 and "matches no line" in match.stdout
    assert row[0] == f"warn {line}", row  # the closest line is the one the package rows use
    detail = row[1]
    assert f"{line}: 2 differ: torch 2.13.0+cpu (pins =={pins['packages']['torch']['version']})" in detail
    assert "vllm-ascend 0.11.0" in detail and f"{other}: " in detail


def test_log_that_cannot_take_a_write_fails_the_run(tmp_path):
    """`--log /dev/full` opens fine and then loses every line: the run said "done" with rc 0. The
    log is probed with a real write, refused naming it; and a log that fails mid-run (here the file
    size limit, RLIMIT_FSIZE, hit after 4 KiB: tee stops) makes the run exit non-zero naming it."""
    import resource

    proc = install(tmp_path, "--dry-run", "--log", "/dev/full")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "LOG_FILE=/dev/full cannot be written (No space left on device" in proc.stderr
    assert "done" not in proc.stdout

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    log = tmp_path / "small.log"
    proc = subprocess.run(["bash", str(SCRIPT), "--workdir", str(tmp_path / "wd"), "--dry-run", "--log", str(log)],
                          env=base_env(tmp_path), capture_output=True, text=True, timeout=120,
                          preexec_fn=small_files)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"LOG_FILE={log}: writing the log failed" in proc.stderr, proc.stderr[-2000:]
    # without the limit the same run passes and its log has every line
    proc = install(tmp_path, "--dry-run", "--log", str(log))
    assert proc.returncode == 0 and "done (dry run" in log.read_text(), proc.stderr[-2000:]
