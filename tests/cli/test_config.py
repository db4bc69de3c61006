"""FlashRL-schema config: loading, validation messages, hybrid selection, atomic writes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from npu_flashrl import config as C


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_roundtrip_and_defaults(tmp_path):
    cfg = C.FlashRLConfig(entries=[
        C.RolloutConfig(fn="int8", model="/m/w8a8", profile="/m/p.pt", load_format="auto",
                        extra={"module_attribute_to_preserve": ["workspace"]}),
        C.RolloutConfig.default("bf16"),
    ])
    path = tmp_path / "cfg.yaml"
    C.write_config(cfg, path)
    raw = yaml.safe_load(path.read_text())
    assert raw["configs"][0] == {"fn": "int8", "model": "/m/w8a8", "profile": "/m/p.pt",
                                 "load_format": "auto", "distributed_executor_backend": "external_launcher",
                                 "module_attribute_to_preserve": ["workspace"]}
    assert raw["configs"][1] == {"fn": "bf16", "load_format": "dummy",
                                 "distributed_executor_backend": "external_launcher"}
    back = C.load_config(str(path))
    assert back.path == str(path)
    assert [e.to_dict() for e in back.entries] == raw["configs"]
    assert back.entries[0].extra == {"module_attribute_to_preserve": ["workspace"]}
    assert C.is_quantized(back.entries[0]) and not C.is_quantized(back.entries[1])


def test_missing_fn_means_int8_and_profile_default(tmp_path):
    path = _write(tmp_path / "c.yaml", """
        configs:
          - model: /ckpt/w8a8
    """)
    entry = C.load_config(path).entries[0]
    assert entry.fn == "int8"
    # as in FlashRL, absent keys do not override vllm.LLM's own kwargs
    assert entry.load_format is None and entry.distributed_executor_backend is None
    assert entry.to_dict() == {"fn": "int8", "model": "/ckpt/w8a8"}
    assert entry.profile_path() == os.path.join("/ckpt/w8a8", "profile.pt")
    assert C.RolloutConfig.default("bf16").profile_path() is None


def test_flashrl_aliases_and_refusals():
    assert C.normalize_fn("int8_fast") == "int8"
    assert C.normalize_fn("int8_wo_prune") == "int8"
    for fn in ("fp8", "fp8_vllm", "fp8_fast", "fp8_vllm_fast", "fp8_channel", "fp8_tensor"):
        with pytest.raises(C.ConfigError, match="no FP8 matmul"):
            C.normalize_fn(fn)
    with pytest.raises(C.ConfigError, match="int8_prune"):
        C.normalize_fn("int8_prune")


def test_shortcuts(monkeypatch):
    monkeypatch.setenv("FLASHRL_CONFIG", "bf16")
    cfg = C.load_config()
    assert [e.fn for e in cfg.entries] == ["bf16"] and cfg.entries[0].load_format == "dummy"
    cfg = C.load_config("int8_profile_free")
    assert cfg.entries[0].fn == "int8_profile_free" and C.is_quantized(cfg.entries[0])
    with pytest.raises(C.ConfigError, match="FP8"):
        C.load_config("fp8")
    with pytest.raises(C.ConfigError, match="needs a model and a profile"):
        C.load_config("int8")


@pytest.mark.parametrize("text,needle", [
    ("configs: [\n  {fn: int8\n", "line"),                        # malformed YAML
    ("foo: 1\n", "missing key `configs`"),
    ("configs: []\n", "non-empty list"),
    ("configs: {fn: int8}\n", "non-empty list"),
    ("- fn: int8\n", "expected a mapping with key `configs`"),
    ("configs:\n  - fn: int8\n  - fn: int4\n", "configs[1].fn: unknown fn 'int4'"),
    ("configs:\n  - fn: fp8_channel\n", "configs[0].fn: fn='fp8_channel' is not supported"),
    ("configs:\n  - 3\n", "configs[0]: expected a mapping"),
    ("configs:\n  - {fn: int8, model: [a]}\n", "configs[0].model: expected a string"),
])
def test_bad_files_name_file_and_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(C.ConfigError) as info:
        C.load_config(str(path))
    msg = str(info.value)
    assert str(path) in msg
    assert needle in msg


def test_malformed_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("configs:\n  - fn: int8\n    model: [unclosed\n")
    with pytest.raises(C.ConfigError, match=r"bad\.yaml: line \d+, column \d+ malformed YAML"):
        C.load_config(str(path))


def test_missing_file_and_env(monkeypatch, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(C.ConfigError, match="nope.yaml.*no such file"):
        C.load_config(missing)
    monkeypatch.setenv("FLASHRL_CONFIG", missing)
    with pytest.raises(C.ConfigError) as info:
        C.load_config()
    assert "FLASHRL_CONFIG=" in str(info.value) and missing in str(info.value)
    monkeypatch.setenv("FLASHRL_CONFIG", "org/repo/flashrl.yaml")
    with pytest.raises(C.ConfigError, match="does not download"):
        C.load_config()
    monkeypatch.delenv("FLASHRL_CONFIG")
    with pytest.raises(C.ConfigError, match="FLASHRL_CONFIG is not set"):
        C.load_config()
    with pytest.raises(C.ConfigError, match="is a directory"):
        C.load_config(str(tmp_path))


def test_hybrid_selection_like_flashrl():
    cfg = C.FlashRLConfig(entries=[C.RolloutConfig.default("int8_profile_free"), C.RolloutConfig.default("bf16")])
    # 8 ranks, TP=2: dp groups 0..3 -> int8, bf16, int8, bf16
    picks = [C.select_entry(cfg, C.dp_rank_from_env(2, 1, {"RANK": str(r)})).fn for r in range(8)]
    assert picks == ["int8_profile_free"] * 2 + ["bf16"] * 2 + ["int8_profile_free"] * 2 + ["bf16"] * 2
    assert C.dp_rank_from_env(2, 2, {"RANK": "7"}) == 1
    with pytest.raises(C.ConfigError, match="RANK is not set"):
        C.dp_rank_from_env(1, 1, {})
    with pytest.raises(C.ConfigError, match="not an integer"):
        C.dp_rank_from_env(1, 1, {"RANK": "x"})


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "cfg.yaml"
    C.write_config(C.FlashRLConfig(entries=[C.RolloutConfig.default("bf16")]), path)
    before = path.read_text()

    # 1) a value yaml cannot represent: refused before the file is touched
    bad = C.FlashRLConfig(entries=[C.RolloutConfig(fn="int8", extra={"x": object()})])
    with pytest.raises(Exception):
        C.write_config(bad, path)
    assert path.read_text() == before

    # 2) a crash in the middle of the write (disk full, kill): previous file intact, no temp left
    def boom(f):
        f.write("configs:\n  - fn: in")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        C.atomic_write(path, boom)
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["cfg.yaml"]

    # 3) failure of the final rename
    def no_replace(src, dst):
        raise OSError("rename failed")
    monkeypatch.setattr(C.os, "replace", no_replace)
    with pytest.raises(OSError, match="rename failed"):
        C.write_config(C.FlashRLConfig(entries=[C.RolloutConfig.default("int8_profile_free")]), path)
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["cfg.yaml"]


def test_flashrl_reads_our_yaml(tmp_path):
    """FlashRL 1.0.3's own reader and selection code consume what write_config produces."""
    cfg = C.FlashRLConfig(entries=[
        C.RolloutConfig(fn="int8", model="/ckpt/w8a8", profile="/ckpt/p.pt", load_format="auto"),
        C.RolloutConfig.default("bf16"),
    ])
    path = str(tmp_path / "cfg.yaml")
    C.write_config(cfg, path)
    code = textwrap.dedent(f"""
        import json
        from flash_rl.vllm_patch import load_flashrl_config, keys_to_overload
        data = load_flashrl_config({path!r})
        out = []
        for rank in range(4):   # FlashRL: dp_rank = RANK // (tp*pp), configs[dp_rank % n]; tp=2
            entry = data['configs'][(rank // 2) % len(data['configs'])]
            out.append({{'fn': entry.get('fn', 'int8'), 'model': entry.get('model'),
                        'kwargs': {{k: entry[k] for k in keys_to_overload if k in entry}}}})
        print(json.dumps(out))
    """)
    env = dict(os.environ, VLLM_PLUGINS="none", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("FLASHRL_CONFIG", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    ours = [C.select_entry(cfg, C.dp_rank_from_env(2, 1, {"RANK": str(r)})) for r in range(4)]
    assert [g["fn"] for g in got] == [e.fn for e in ours] == ["int8", "int8", "bf16", "bf16"]
    assert got[0]["model"] == "/ckpt/w8a8" and got[2]["model"] is None
    assert got[0]["kwargs"] == {"load_format": "auto", "distributed_executor_backend": "external_launcher"}
    assert got[2]["kwargs"] == {"load_format": "dummy", "distributed_executor_backend": "external_launcher"}


def test_every_registered_fn_has_entry_defaults():
    """`npu-flashrl setup --fn <fn>` builds the entry from `RolloutConfig.default(fn)`: every
    supported fn has defaults (w4a8_profile_free: the online fns' load_format auto)."""
    from npu_flashrl import config as C

    for fn in C.SUPPORTED_FNS:
        assert C.RolloutConfig.default(fn).fn == fn
    assert C.RolloutConfig.default("w4a8_profile_free").load_format == "auto"
