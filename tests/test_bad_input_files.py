"""Bad checkpoints and configs (issue 22, items 5 and 6): refused by `setup` and `verify` for every
fn, naming the file and what was expected, with nothing written.

* corrupt shards (truncated, a header length of 2^40 bytes, data offsets past the end, a file with
  no tensors, an index naming a tensor its shard lacks) pass no fn: every shard's header is read,
  without tensor data;
* configs: entries describing different models, duplicate YAML keys, a `weight_map` entry leaving
  the checkpoint dir, `-o` with surrounding whitespace; `-o` through a symlink writes through it
  (and says so); `verify --config C --verl-overrides F` checks F as an INT8 rollout's whatever the
  shell's FLASHRL_CONFIG.

Helpers and fixtures (`w`: a tiny bf16/W8A8 pair, `d`: a work dir) are test_bad_input.py's.
"""
import json
import os
import shutil
import struct

import pytest
import yaml

from npu_flashrl import cli
from npu_flashrl import config as C
from test_bad_input import Case, check, cli_runner, d, inproc, snapshot, w  # noqa: F401 (fixtures)


# ------------------------------------------------------------------------------------------ corrupt shards

def _rewrite(path, fn):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = fn(data, n, header)
    with open(path, "wb") as f:
        f.write(out)


def _header_bytes(header) -> bytes:
    b = json.dumps(header).encode()
    return b + b" " * ((8 - len(b) % 8) % 8)


def _truncated(data, n, header):
    return data[:len(data) - 100]


def _huge_header(data, n, header):
    return struct.pack("<Q", 2 ** 40) + data[8:]


def _offsets_past_end(data, n, header):
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 10 ** 9]
    b = _header_bytes(header)
    return struct.pack("<Q", len(b)) + b + data[8 + n:]


def _no_tensors(data, n, header):
    b = _header_bytes({"__metadata__": {"format": "pt"}})
    return struct.pack("<Q", len(b)) + b


CORRUPTIONS = {"truncated": (_truncated, "truncated or corrupt"), "huge_header": (_huge_header, "header too large"),
               "offsets_past_end": (_offsets_past_end, "truncated or corrupt"),
               "no_tensors": (_no_tensors, "no tensors")}


@pytest.fixture(scope="module")
def bad(w, tmp_path_factory):
    """Copies of the bf16 model (one shard) and of the W8A8 one (indexed, three shards), each with
    one corruption."""
    base = tmp_path_factory.mktemp("bad_files")
    out = {}
    for name, (fn, _) in CORRUPTIONS.items():
        for kind, src in (("bf16", w.bf16), ("w8a8", w.w8a8)):
            dst = base / f"{kind}_{name}"
            shutil.copytree(src, dst)
            shard = sorted(p for p in os.listdir(dst) if p.endswith(".safetensors"))[0]
            _rewrite(dst / shard, fn)
            out[kind, name] = (str(dst), str(dst / shard))
    # an index naming a tensor its shard does not have
    dst = base / "w8a8_index_lies"
    shutil.copytree(w.w8a8, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = sorted(set(index["weight_map"].values()))[0]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    out["index_lies"] = str(dst)
    # an index entry reaching out of the dir (the other model's shard sits next to it)
    dst = base / "w8a8_escapes"
    shutil.copytree(w.w8a8, dst)
    shutil.copy(os.path.join(w.bf16, "model.safetensors"), base / "outside.safetensors")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    victim = next(k for k in index["weight_map"] if k.endswith("q_proj.weight"))
    index["weight_map"][victim] = "../outside.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    out["escapes"] = (str(dst), victim)
    dst = base / "w8a8_absolute"
    shutil.copytree(w.w8a8, dst)
    index["weight_map"][victim] = str(base / "outside.safetensors")
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    out["absolute"] = (str(dst), victim)
    return out


@pytest.mark.parametrize("fn", ["bf16", "int8_profile_free"])
@pytest.mark.parametrize("kind", ["bf16", "w8a8"])
@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_setup_reads_every_shard_header_for_every_fn(bad, d, fn, kind, name):
    model, shard = bad[kind, name]
    check(Case(["setup", "-m", model, "--fn", fn, "-o", d / "c.yaml"], 1, [shard, CORRUPTIONS[name][1]],
               [d, model]), inproc)


@pytest.mark.parametrize("fn", ["bf16", "int8_profile_free"])
@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_verify_reads_every_shard_header_for_every_fn(bad, d, fn, name, capsys):
    model, shard = bad["w8a8", name]
    cfg = d / "v.yaml"
    cfg.write_text(json.dumps({"configs": [{"fn": fn, "model": model, "load_format": "auto"}]}))
    before = snapshot(d, model)
    assert cli.main(["verify", "--config", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert shard in out and CORRUPTIONS[name][1] in out, out
    assert "all required checks passed" not in out
    assert snapshot(d, model) == before


def test_index_naming_a_tensor_its_shard_lacks(bad, d):
    check(Case(["setup", "-m", bad["index_lies"], "--fn", "bf16", "-o", d / "c.yaml"], 1,
               ["model.layers.9.mlp.up_proj.weight", "model.safetensors.index.json", "no such tensor"], [d]), inproc)


@pytest.mark.parametrize("which", ["escapes", "absolute"])
def test_weight_map_outside_the_checkpoint_dir_is_refused(bad, d, which, capsys):
    model, victim = bad[which]
    check(Case(["setup", "-m", model, "--fn", "int8_profile_free", "-o", d / "c.yaml"], 1,
               ["model.safetensors.index.json", victim, "inside the checkpoint dir"], [d]), inproc)
    cfg = d / "v.yaml"
    cfg.write_text(json.dumps({"configs": [{"fn": "bf16", "model": model}]}))
    assert cli.main(["verify", "--config", str(cfg)]) == 1
    assert "inside the checkpoint dir" in capsys.readouterr().out


def test_good_checkpoints_still_pass(w, d):
    for model, fn in ((w.bf16, "int8_profile_free"), (w.w8a8, "bf16")):
        proc = check(Case(["setup", "-m", model, "--fn", fn, "-o", d / f"{fn}.yaml"], 0, ["written to"], []), inproc)
        assert proc


# ------------------------------------------------------------------------------------------ configs

def test_verify_refuses_entries_of_different_models(w, d, tmp_path, capsys):
    """Two entries whose models differ (hidden 128 vs 256): refused by verify and by setup -a."""
    other = tmp_path / "wide"
    shutil.copytree(w.bf16, other)
    conf = json.loads((other / "config.json").read_text())
    conf["hidden_size"] = conf["hidden_size"] * 2
    (other / "config.json").write_text(json.dumps(conf))
    cfg = d / "two.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free", "model": w.bf16},
                                               {"fn": "bf16", "model": str(other), "load_format": "dummy"}]}))
    before = snapshot(d)
    assert cli.main(["verify", "--config", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "hidden_size" in out and "configs[0]" in out and "configs[1]" in out and "different models" in out, out
    assert snapshot(d) == before
    one = d / "one.yaml"
    one.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free", "model": w.bf16}]}))
    check(Case(["setup", "-a", "-m", other, "--fn", "bf16", "-o", one], 1, ["hidden_size", "different models",
                                                                           "not appended"], [d]), inproc)
    # the same model twice (bf16 and its W8A8 checkpoint) is one model
    proc = check(Case(["setup", "-a", "-m", w.w8a8, "--fn", "bf16", "-o", one], 0, ["2 entries"], []), inproc)
    assert proc


@pytest.mark.parametrize("text, key, line", [
    ("configs:\n- fn: int8\n  fn: bf16\n", "'fn'", 3),
    ("configs:\n- fn: bf16\nconfigs:\n- fn: int8_profile_free\n", "'configs'", 3),
    ("configs:\n- {fn: bf16, load_format: dummy, load_format: auto}\n", "'load_format'", 2),
])
def test_duplicate_yaml_keys_are_refused(d, capsys, text, key, line):
    cfg = d / "dup.yaml"
    cfg.write_text(text)
    with pytest.raises(C.ConfigError) as err:
        C.load_config(str(cfg))
    msg = str(err.value)
    assert str(cfg) in msg and f"line {line}" in msg and key in msg and "duplicate key" in msg, msg
    assert cli.main(["verify", "--config", str(cfg)]) == 1
    assert "duplicate key" in capsys.readouterr().out
    check(Case(["setup", "-a", "--fn", "bf16", "-o", cfg], 1, ["duplicate key", key], [d]), inproc)


@pytest.mark.parametrize("around", [("", " "), (" ", ""), ("", "\t")])
def test_setup_output_with_surrounding_whitespace_is_refused(d, around):
    """FLASHRL_CONFIG is read stripped: `-o "c.yaml "` wrote a file activation could not find."""
    path = around[0] + str(d / "x" / "c.yaml") + around[1]
    check(Case(["setup", "--fn", "bf16", "-o", path], 1, ["whitespace", repr(path)], [d, d / "x"]), inproc)


def test_setup_output_through_a_symlink_writes_through_it(d):
    target = d / "real" / "c.yaml"
    target.parent.mkdir()
    target.write_text("configs:\n- fn: bf16\n")
    link = d / "link.yaml"
    link.symlink_to(target)
    proc = check(Case(["setup", "--fn", "int8_profile_free", "-o", link], 0, ["through the symlink", str(target)], []),
                 cli_runner)
    assert proc
    assert link.is_symlink() and os.readlink(link) == str(target), "the link was replaced"
    assert C.load_config(str(target)).entries[0].fn == "int8_profile_free"
    proc = check(Case(["setup", "-a", "--fn", "bf16", "-o", link], 0, ["2 entries", "through the symlink"], []),
                 cli_runner)
    assert link.is_symlink() and len(C.load_config(str(target)).entries) == 2


# per verl line, an override refused for an INT8 (FLASHRL_CONFIG) rollout only: at 51d2104 the async
# rollout never builds the INT8 engine; at 0.7+ verl's own quantized rollout clashes with it
REFUSED = {"51d2104": ("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.mode"),
           "0.9": ("actor_rollout_ref.rollout.quantization=fp8", "actor_rollout_ref.rollout.quantization")}


@pytest.mark.parametrize("verl", sorted(REFUSED))
@pytest.mark.parametrize("shell_config", [None, ""])
def test_verify_config_with_overrides_refuses_the_wrong_mode_whatever_the_shell(d, monkeypatch, verl, shell_config):
    """`verify --config C --verl-overrides F` checks F as the rollout of C (at verl 51d2104 an async
    rollout never builds the INT8 engine; at 0.7+ verl's own quantization clashes): it was passed
    unless FLASHRL_CONFIG was also exported."""
    from npu_flashrl import verify

    (d / "ov.txt").write_text(f"{REFUSED[verl][0]}\nactor_rollout_ref.rollout.calculate_log_probs=True\n")
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    if shell_config is not None:
        monkeypatch.setenv("FLASHRL_CONFIG", shell_config)
    rows = verify.verl_rows(str(d / "ov.txt"), verl=verl, config_path="int8_profile_free")
    assert [r["status"] for r in rows] == ["FAIL"], rows
    assert REFUSED[verl][1] in rows[0]["detail"], rows


def test_verify_cli_config_with_overrides_of_the_installed_line(d):
    from npu_flashrl import compat

    override, key = REFUSED[compat.verl_line()]
    (d / "ov.txt").write_text(override + "\n")
    text = check(Case(["verify", "--config", "int8_profile_free", "--verl-overrides", d / "ov.txt"], 1,
                      [key], [d]), cli_runner)
    assert "all required checks passed" not in text
