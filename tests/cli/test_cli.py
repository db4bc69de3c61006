"""`npu-flashrl` end to end on tiny bf16 / compressed-tensors W8A8 checkpoints."""
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from npu_flashrl import cli, commands, verify
from npu_flashrl import config as C
from npu_flashrl import profile as P
from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"compressed-tensors cannot be imported ({exc}): add frozendict to "
                    f"requirements/cpu-stack-<line>.txt [deps]")
    return tiny_checkpoint_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def other_ckpts(tmp_path_factory):
    """A different tiny model (MLP width 320): its profile does not fit `ckpts`."""
    return tiny_checkpoint_pair(str(tmp_path_factory.mktemp("other")), seed=3,
                                config_overrides={"intermediate_size": 320})


@pytest.fixture(scope="module")
def profile_pt(ckpts, tmp_path_factory):
    bf16, w8a8 = ckpts
    out = str(tmp_path_factory.mktemp("prof") / "profile.pt")
    assert cli.main(["profile", "-m", bf16, "-q", w8a8, "-o", out, "--fn", "int8", "--no-progress"]) == 0
    return out


def _files(d):
    return sorted(os.listdir(d))


@pytest.mark.parametrize("cmd", [[], ["profile"], ["setup"], ["cleanup"], ["verify"]])
def test_help_everywhere(cmd, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(cmd + ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: npu-flashrl")
    if cmd == ["setup"]:
        assert "int8_profile_free" in out and "key=value" in out


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "npu-flashrl")
    res = subprocess.run([exe, "setup", "--help"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, VLLM_PLUGINS="none", TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert res.returncode == 0 and "--config-output" in res.stdout, res.stderr[-2000:]


def test_profile_command(ckpts, profile_pt, capsys):
    bf16, w8a8 = ckpts
    prof = P.load_profile(profile_pt)
    direct = P.compute_int8_profile(bf16, w8a8, progress=False)
    assert list(prof) == list(direct)
    assert all(torch.equal(prof[k]["output_scale"], direct[k]["output_scale"])
               for k in prof if isinstance(prof[k]["output_scale"], torch.Tensor))


def test_profile_command_errors(ckpts, tmp_path, capsys):
    bf16, w8a8 = ckpts
    out = str(tmp_path / "p.pt")
    assert cli.main(["profile", "-q", w8a8, "-o", out, "--fn", "fp8"]) == 2
    assert "FP8" in capsys.readouterr().err
    assert cli.main(["profile", "-q", w8a8, "-o", out]) == 2
    assert "-m BF16_DIR" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["profile", "-m", str(empty), "-q", w8a8, "-o", out]) == 1
    err = capsys.readouterr().err
    assert "npu-flashrl profile: error:" in err and str(empty) in err and "safetensors" in err
    assert not os.path.exists(out)


def test_setup_hybrid_and_flashrl_schema(ckpts, profile_pt, tmp_path, capsys):
    _, w8a8 = ckpts
    cfg_path = str(tmp_path / "flashrl.yaml")
    assert cli.main(["setup", "-m", w8a8, "-p", profile_pt, "--fn", "int8", "-o", cfg_path,
                     "module_attribute_to_preserve=[\"workspace\"]",
                     'distributed_executor_backend="external_launcher"']) == 0
    assert cli.main(["setup", "-a", "--fn", "bf16", "-o", cfg_path]) == 0   # FlashRL asserts here
    raw = yaml.safe_load(open(cfg_path))
    assert [c["fn"] for c in raw["configs"]] == ["int8", "bf16"]
    assert raw["configs"][0]["model"] == w8a8 and raw["configs"][0]["profile"] == profile_pt
    assert raw["configs"][0]["module_attribute_to_preserve"] == ["workspace"]
    assert raw["configs"][0]["distributed_executor_backend"] == "external_launcher"
    assert raw["configs"][1]["load_format"] == "dummy"
    cfg = C.load_config(cfg_path)
    assert [C.select_entry(cfg, r).fn for r in range(4)] == ["int8", "bf16", "int8", "bf16"]
    assert cli.main(["setup", "-a", "--fn", "int8_profile_free", "-o", cfg_path]) == 0
    assert [e.fn for e in C.load_config(cfg_path).entries] == ["int8", "bf16", "int8_profile_free"]
    assert f"FLASHRL_CONFIG={cfg_path}" in capsys.readouterr().out


def test_setup_values_are_literals_never_eval(tmp_path):
    cfg_path = str(tmp_path / "c.yaml")
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    # --force: these test keys are not entry keys npu_flashrl or FlashRL read (refused without it)
    assert cli.main(["setup", "--fn", "bf16", "-o", cfg_path, "--force", f"evil={payload}", "n=3", "flag=True",
                     "words=plain text", "lst=[1, 'a']", "yml={a: 1}", "none=None", "null=null"]) == 0
    entry = C.load_config(cfg_path).entries[0]
    assert not marker.exists()
    assert entry.extra["evil"] == payload
    assert entry.extra["n"] == 3 and entry.extra["flag"] is True and entry.extra["words"] == "plain text"
    assert entry.extra["lst"] == [1, "a"] and entry.extra["yml"] == {"a": 1}
    assert entry.extra["none"] is None and entry.extra["null"] is None
    assert commands.parse_value("auto") == "auto"


@pytest.mark.parametrize("argv,code,needle", [
    (["--fn", "int4"], 2, "unknown fn 'int4'"),
    (["--fn", "fp8_vllm"], 2, "no FP8 matmul"),
    (["--fn", "int8_prune"], 2, "int8_prune"),
    (["--fn", "int8"], 2, "needs -m MODEL"),
    (["--fn", "bf16", "novalue"], 2, "expected key=value"),
])
def test_setup_bad_args_write_nothing(tmp_path, argv, code, needle, capsys):
    cfg_path = str(tmp_path / "c.yaml")
    assert cli.main(["setup", "-o", cfg_path] + argv) == code
    assert needle in capsys.readouterr().err
    assert _files(tmp_path) == []


def _contradictions(w8a8, profile_pt, tmp_path):
    return {
        "fn": (["--fn", "int8_profile_free", "-m", w8a8, "fn=bf16"], ["--fn int8_profile_free", "fn=bf16"]),
        "alias": (["--fn", "int8_fast", "-m", w8a8, "-p", profile_pt, "fn=bf16"], ["--fn int8_fast", "fn=bf16"]),
        "wire twice": (["--fn", "int8_profile_free", "-m", w8a8, "wire=int8", "wire=float"],
                       ["'wire=int8'", "'wire=float'"]),
        "model": (["--fn", "bf16", "-m", w8a8, f"model={tmp_path / 'other'}"], [f"-m {w8a8}", "model="]),
        "profile": (["--fn", "int8", "-m", w8a8, "-p", profile_pt, f"profile={tmp_path / 'x.pt'}"],
                    [f"-p {profile_pt}", "profile="]),
        "profile word, profile-free": (["--fn", "int8_profile_free", "-m", w8a8, f"profile={tmp_path / 'x.pt'}"],
                                       [f"profile={tmp_path / 'x.pt'}", "only --fn int8 uses a profile"]),
    }


@pytest.mark.parametrize("name", ["fn", "alias", "wire twice", "model", "profile", "profile word, profile-free"])
def test_setup_refuses_words_contradicting_flags(ckpts, profile_pt, tmp_path, capsys, name):
    """A key=value word that contradicts a flag, or another word, was applied silently (the last
    one won); now refused naming both, nothing written."""
    argv, needles = _contradictions(ckpts[1], profile_pt, tmp_path)[name]
    assert cli.main(["setup", "-o", str(tmp_path / "c.yaml"), *argv]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert "give it once" in err or "drop it" in err, err
    assert _files(tmp_path) == []


def test_setup_words_agreeing_with_flags_and_relative_paths(ckpts, profile_pt, tmp_path, monkeypatch, capsys):
    """Words that agree with the flags (an alias, the same path spelled another way) are accepted;
    local paths are written absolute, so the config works from any directory (`verify` elsewhere,
    vLLM workers); a name that is no local path (a hub id, --no-check) is kept as given."""
    _, w8a8 = ckpts
    parent, name = os.path.split(w8a8)
    monkeypatch.chdir(parent)
    rel_profile = os.path.relpath(profile_pt)
    out = str(tmp_path / "c.yaml")
    assert cli.main(["setup", "-m", name, "-p", rel_profile, "--fn", "int8_fast", "-o", out,
                     f"model=./{name}", "fn=int8", "load_format=auto", "load_format=auto"]) == 0
    entry = yaml.safe_load(open(out))["configs"][0]
    assert entry["model"] == w8a8 and entry["profile"] == profile_pt and entry["fn"] == "int8"
    assert f"export FLASHRL_CONFIG={out}" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)  # another directory: the written paths still resolve
    code, data = _verify(["--config", out], monkeypatch, capsys)
    assert code == 0, [r for r in data["rows"] if r["status"] == "FAIL"]
    hub = str(tmp_path / "hub.yaml")
    assert cli.main(["setup", "--fn", "bf16", "--no-check", "-m", "Qwen/Qwen2.5-7B", "-o", hub]) == 0
    assert yaml.safe_load(open(hub))["configs"][0]["model"] == "Qwen/Qwen2.5-7B"
    # fn from a word alone (no --fn): taken, not contradicted by --fn's default
    only_word = str(tmp_path / "w.yaml")
    assert cli.main(["setup", "-o", only_word, "fn=bf16"]) == 0
    assert C.load_config(only_word).entries[0].fn == "bf16"


def test_setup_refuses_mismatched_profile(ckpts, other_ckpts, profile_pt, tmp_path, capsys):
    _, w8a8 = ckpts
    _, other_w8a8 = other_ckpts
    cfg_path = tmp_path / "c.yaml"
    assert cli.main(["setup", "--fn", "bf16", "-o", str(cfg_path)]) == 0
    before = cfg_path.read_text()
    # profile made for `ckpts`, model is the other one; appending must not touch the config
    assert cli.main(["setup", "-a", "-m", other_w8a8, "-p", profile_pt, "--fn", "int8",
                     "-o", str(cfg_path)]) == 1
    err = capsys.readouterr().err
    assert "does not match model" in err and "first offenders" in err
    assert "model.layers.0.mlp.gate_proj.weight: profile output_scale [352, 1]" in err
    assert cfg_path.read_text() == before and _files(tmp_path) == ["c.yaml"]
    # profile missing
    assert cli.main(["setup", "-m", w8a8, "-p", str(tmp_path / "nope.pt"), "-o", str(tmp_path / "d.yaml")]) == 1
    assert "nope.pt: profile not found" in capsys.readouterr().err
    # no -p: FlashRL's default <model>/profile.pt, which does not exist
    assert cli.main(["setup", "-m", w8a8, "-o", str(tmp_path / "d.yaml")]) == 1
    assert os.path.join(w8a8, "profile.pt") in capsys.readouterr().err
    # model dir without safetensors
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["setup", "-m", str(empty), "-p", profile_pt, "-o", str(tmp_path / "d.yaml")]) == 1
    assert "no *.safetensors" in capsys.readouterr().err
    # -a onto a malformed config: refused, file intact
    bad = tmp_path / "bad.yaml"
    bad.write_text("configs: [\n")
    assert cli.main(["setup", "-a", "--fn", "bf16", "-o", str(bad)]) == 1
    assert "bad.yaml" in capsys.readouterr().err and bad.read_text() == "configs: [\n"
    assert "d.yaml" not in _files(tmp_path)


FLASHRL_USERCUSTOMIZE = "import os\ntry: import flash_rl\nexcept ImportError: pass\nX = 1\n"


def test_cleanup_usercustomize(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    uc = site_dir / "usercustomize.py"
    uc.write_text(FLASHRL_USERCUSTOMIZE)
    os.chmod(uc, 0o640)
    assert cli.main(["cleanup", "--site-dir", str(site_dir), "--dry-run"]) == 0
    assert uc.read_text() == FLASHRL_USERCUSTOMIZE
    assert cli.main(["cleanup", "--site-dir", str(site_dir)]) == 0
    assert "disabled `import flash_rl`" in capsys.readouterr().out
    text = uc.read_text()
    assert text == "import os\n# try: import flash_rl\n# except ImportError: pass\nX = 1\n"
    assert os.stat(uc).st_mode & 0o777 == 0o640
    compile(text, str(uc), "exec")
    from npu_flashrl.adapters.flashrl import usercustomize_files
    assert usercustomize_files([str(site_dir)]) == []
    assert cli.main(["cleanup", "--site-dir", str(site_dir)]) == 0   # idempotent
    assert uc.read_text() == text and "nothing to clean up" in capsys.readouterr().out
    # plain form, and an unknown form that must be left for a human
    uc.write_text("import flash_rl\n")
    assert cli.main(["cleanup", "--site-dir", str(site_dir)]) == 0
    assert uc.read_text() == "# import flash_rl\n"
    uc.write_text("import sys, flash_rl; import flash_rl as f\n")
    assert cli.main(["cleanup", "--site-dir", str(site_dir)]) == 1
    assert "unknown form" in capsys.readouterr().err
    assert uc.read_text() == "import sys, flash_rl; import flash_rl as f\n"


def test_cleanup_config(tmp_path, capsys):
    cfg_path = tmp_path / "c.yaml"
    assert cli.main(["setup", "--fn", "bf16", "-o", str(cfg_path)]) == 0
    other = tmp_path / "notes.yaml"
    other.write_text("hello: world\n")
    assert cli.main(["cleanup", "--site-dir", str(tmp_path), "-p", str(other)]) == 1
    assert other.exists() and "not a FlashRL config" in capsys.readouterr().err
    assert cli.main(["cleanup", "--site-dir", str(tmp_path), "-p", str(cfg_path)]) == 0
    assert not cfg_path.exists()


# ---------------------------------------------------------------------------- verify

def _verify(argv, monkeypatch, capsys, env=None):
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    code = cli.main(["verify", "--json"] + argv)
    data = json.loads(capsys.readouterr().out)
    return code, data


def _rows(data, prefix):
    return [r for r in data["rows"] if r["check"].startswith(prefix)]


def test_verify_good_setup(ckpts, profile_pt, tmp_path, monkeypatch, capsys):
    _, w8a8 = ckpts
    cfg_path = str(tmp_path / "c.yaml")
    assert cli.main(["setup", "-m", w8a8, "-p", profile_pt, "-o", cfg_path]) == 0
    assert cli.main(["setup", "-a", "--fn", "bf16", "-o", cfg_path]) == 0
    capsys.readouterr()
    code, data = _verify(["--config", cfg_path], monkeypatch, capsys)
    assert code == 0 and data["ok"] is True, [r for r in data["rows"] if r["status"] == "FAIL"]
    assert _rows(data, "configs[0]")[0]["status"] == "ok"
    assert "matches model" in _rows(data, "configs[0]")[0]["detail"]
    names = {r["check"] for r in data["rows"]}
    for pkg in ("package torch", "package vllm", "package vllm-ascend", "package transformers",
                "package torch_npu", "CANN toolkit"):
        assert pkg in names
    assert _rows(data, "package torch_npu")[0]["detail"].startswith("emulated")
    assert any(r["check"] == "patch flashrl_yield_to_npu_flashrl" for r in data["rows"])
    # the same through FLASHRL_CONFIG, as a table
    monkeypatch.setenv("FLASHRL_CONFIG", cfg_path)
    assert cli.main(["verify"]) == 0
    out = capsys.readouterr().out
    assert "CHECK" in out and "all required checks passed" in out
    # strict: emulation counts as a failure on a machine without an NPU
    assert cli.main(["verify", "--strict"]) == 1


def test_verify_bad_setups(ckpts, other_ckpts, profile_pt, tmp_path, monkeypatch, capsys):
    _, w8a8 = ckpts
    _, other_w8a8 = other_ckpts

    def cfg(name, entry):
        path = tmp_path / name
        path.write_text(yaml.safe_dump({"configs": [entry]}))
        return str(path)

    cases = {
        "malformed": (str(tmp_path / "m.yaml"), "malformed YAML"),
        "nowhere": (str(tmp_path / "absent.yaml"), "no such file"),
        "no profile": (cfg("a.yaml", {"fn": "int8", "model": w8a8, "profile": str(tmp_path / "x.pt")}),
                       "profile not found"),
        "other model": (cfg("b.yaml", {"fn": "int8", "model": other_w8a8, "profile": profile_pt}),
                        "does not match model"),
        "no safetensors": (cfg("c.yaml", {"fn": "int8", "model": str(tmp_path), "profile": profile_pt}),
                           "no *.safetensors"),
        "unknown fn": (cfg("d.yaml", {"fn": "int2"}), "unknown fn"),
        # a profile named but missing fails whatever the fn (it passed for fns that use no profile)
        "missing profile, profile-free": (cfg("e.yaml", {"fn": "int8_profile_free", "model": w8a8,
                                                         "profile": str(tmp_path / "x.pt")}), "no such file"),
    }
    (tmp_path / "m.yaml").write_text("configs:\n  - fn: [\n")
    for label, (path, needle) in cases.items():
        code, data = _verify([], monkeypatch, capsys, env={"FLASHRL_CONFIG": path})
        failing = [r for r in data["rows"] if r["status"] == "FAIL"]
        assert code == 1 and data["ok"] is False, label
        assert any(needle in r["detail"] for r in failing), (label, failing)
        assert all(r["fix"] for r in failing), (label, failing)


def test_verify_cann_detection(tmp_path, monkeypatch):
    root = tmp_path / "latest"
    (root / "aarch64-linux").mkdir(parents=True)
    (root / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.2.RC3\narch=aarch64\n")
    assert verify.cann_version([str(root)])["version"] == "8.2.RC3"
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(root))
    row = verify.cann_row({"cann": "8.2.RC3"})
    assert row["status"] == "ok" and "8.2.RC3" in row["detail"]
    assert verify.cann_row({"cann": "8.3.RC1"})["status"] == "warn"
    assert verify.cann_version([str(tmp_path / "none")]) is None
