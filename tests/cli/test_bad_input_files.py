"""Bad checkpoints and configs: refused by `setup` and `verify` for every
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
import sys

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


def test_yaml_merge_keys_are_read_as_flashrl_reads_them(d, capsys):
    """`<<: *base` (YAML merge keys; FlashRL's yaml.safe_load reads them) was refused as "malformed
    YAML" by the duplicate-key check; the mapping's own keys override merged ones (what a merge is
    for), and a key given twice in one mapping is still refused."""
    text = ("base: &base\n  fn: int8_profile_free\n  load_format: auto\n"
            "configs:\n- <<: *base\n  module_attribute_to_preserve: [workspace]\n- <<: [*base]\n  fn: bf16\n  load_format: dummy\n")
    cfg = d / "merge.yaml"
    cfg.write_text(text)
    assert C.load_yaml_unique(text) == yaml.safe_load(text)
    entries = C.load_config(str(cfg)).entries
    assert [(e.fn, e.load_format, e.extra) for e in entries] == [
        ("int8_profile_free", "auto", {"module_attribute_to_preserve": ["workspace"]}), ("bf16", "dummy", {})]
    assert cli.main(["verify", "--config", str(cfg)]) == 0, capsys.readouterr().out
    (d / "dup.yaml").write_text(text + "  fn: int8\n")
    with pytest.raises(C.ConfigError, match=r"line 10.*duplicate key 'fn' \(first at line 8"):
        C.load_config(str(d / "dup.yaml"))


_FIFO_CHILD = """
import contextlib, io, json, os, signal, sys

args = json.loads(sys.argv[1])
from npu_flashrl import cli, config as C


def on_alarm(*_):
    raise TimeoutError("hung")


signal.signal(signal.SIGALRM, on_alarm)
out = {}
for name, argv, env in args["cases"]:
    os.environ.pop("FLASHRL_CONFIG", None)
    os.environ.update(env)
    o, e = io.StringIO(), io.StringIO()
    signal.alarm(20)
    try:
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            if argv == ["load_config"]:
                try:
                    C.load_config()
                    code = 0
                except C.ConfigError as exc:
                    print(exc, file=sys.stderr)
                    code = 1
            else:
                code = cli.main(argv)
    except TimeoutError:
        code = "HUNG"
    signal.alarm(0)
    out[name] = [code, o.getvalue() + e.getvalue()]
print("RESULTS" + json.dumps(out))
"""


def test_fifos_are_refused_by_name_without_opening(w, d):
    """A FIFO as FLASHRL_CONFIG, `verify --config`, `setup -p`, `cleanup -p` or a model shard: opening
    it waits for a writer forever (every vLLM worker and Ray hook reading it would hang with it).
    Each is refused naming the path, unopened. One child process for the group; each case has an
    alarm, so a regression reports HUNG instead of hanging the suite."""
    import subprocess
    import sys

    from cli_env import cli_env

    fifo = d / "pipe.yaml"
    os.mkfifo(fifo)
    model = d / "model"
    shutil.copytree(w.w8a8, model)
    shard = sorted(p for p in os.listdir(model) if p.endswith(".safetensors"))[-1]
    os.remove(model / shard)
    os.mkfifo(model / shard)
    cases = [
        ("FLASHRL_CONFIG", ["load_config"], {"FLASHRL_CONFIG": str(fifo)}),
        ("verify --config", ["verify", "--config", str(fifo)], {}),
        ("setup -p", ["setup", "-m", w.w8a8, "-p", str(fifo), "--fn", "int8", "-o", str(d / "c.yaml")], {}),
        ("cleanup -p", ["cleanup", "-p", str(fifo), "--site-dir", str(d / "outdir")], {}),
        ("setup shard", ["setup", "-m", str(model), "--fn", "int8_profile_free", "-o", str(d / "c.yaml")], {}),
        ("verify shard", ["verify", "--config", str(d / "shard.yaml")], {}),
    ]
    (d / "shard.yaml").write_text(yaml.safe_dump({"configs": [{"fn": "bf16", "model": str(model)}]}))
    before = snapshot(d)
    proc = subprocess.run([sys.executable, "-c", _FIFO_CHILD, json.dumps({"cases": cases})], env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RESULTS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS", 1)[1])
    named = {"FLASHRL_CONFIG": f"FLASHRL_CONFIG='{fifo}'", "setup -p": f"-p: {fifo}", "cleanup -p": f"-p {fifo}",
             "setup shard": str(model / shard), "verify shard": str(model / shard)}
    for name, (code, text) in results.items():
        assert code == 1, (name, code, text[-2000:])
        assert "is a FIFO (named pipe), not a regular file" in text, (name, text[-2000:])
        assert named.get(name, str(fifo)) in text, (name, text[-2000:])
    assert "not removed" in results["cleanup -p"][1]
    assert snapshot(d) == before, "a file was written, or the FIFO removed"


def test_cleanup_takes_setups_lock(d):
    """`cleanup -p` racing `setup -a` on one config reported "removed" and then the append's write
    brought the file back. Now cleanup takes the lock setup -a holds for its read-modify-write
    (config.locked_file): it waits for the append, then removes what the append wrote; and an
    append that waited for cleanup's lock says the file is gone instead of writing it back."""
    import threading

    from npu_flashrl import commands
    from npu_flashrl.errors import CliError

    cfg = d / "flashrl.yaml"
    site = d / "outdir"
    done = []
    with C.locked_file(str(cfg)):  # setup -a's read-modify-write is in progress
        cleaner = threading.Thread(target=lambda: done.append(commands.cleanup(str(cfg), [str(site)])))
        cleaner.start()
        cleaner.join(1.5)
        assert cleaner.is_alive() and not done and cfg.exists(), "cleanup did not wait for setup -a's lock"
        two = C.load_config(str(cfg))
        two.entries.append(C.RolloutConfig.default("int8_profile_free"))
        C.write_config(two, str(cfg))  # the append's write, under its lock
    cleaner.join(30)
    assert done and any(f"removed config {cfg}" in n for n in done[0]), done
    assert not cfg.exists(), "the config came back after cleanup said removed"

    cfg.write_text("configs:\n- fn: bf16\n")
    failed = []

    def append():
        try:
            commands.setup("bf16", output=str(cfg), append=True)
        except CliError as exc:
            failed.append(str(exc))

    with C.locked_file(str(cfg)):  # cleanup holds the lock and removes the file
        appender = threading.Thread(target=append)
        appender.start()
        appender.join(1.5)
        assert appender.is_alive(), "setup -a did not wait for the lock"
        os.remove(cfg)
    appender.join(30)
    assert failed and "no longer exists" in failed[0] and "nothing appended" in failed[0], failed
    assert not cfg.exists()


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
    from npu_flashrl import lines
    override, key = REFUSED[lines.verl_line()]
    (d / "ov.txt").write_text(override + "\n")
    text = check(Case(["verify", "--config", "int8_profile_free", "--verl-overrides", d / "ov.txt"], 1,
                      [key], [d]), cli_runner)
    assert "all required checks passed" not in text


def test_a_pipe_with_a_writer_is_refused_for_what_it_is(w, d):
    """`verify --config <(cat file)`: the pipe has a writer, so it would not wait; it is refused
    because a pipe is read once (every vLLM worker and Ray actor reads the config path), and the
    message says so instead of "would wait for input forever"."""
    import subprocess

    from cli_env import cli_env

    cfg = d / "c.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "bf16"}]}))
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" -m npu_flashrl.cli verify --config <(cat "{cfg}")'],
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "a pipe is read once" in proc.stdout and "wait for input forever" not in proc.stdout, proc.stdout[-2000:]
