"""Inputs that fail with a raw traceback or a misleading message: each now gets
one message naming the file, flag or tensor and what was expected, nothing written.

Stand-ins, by name: "unreadable" / "read-only" inputs drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
as cli_env.drop_dac does (tests run as root); a "malicious" profile is a pickle naming a
harmless class of this module (torch's weights_only loader refuses any such global before running
it). Fixtures (`w`: a tiny bf16/W8A8 pair with a profile, `d`: a work dir) are test_bad_input.py's.
"""
import json
import os
import shutil
import struct
import sys

import pytest
import torch

from cli_env import cli_env
from test_bad_input import NEEDS_DAC_DROP, Case, check, cli_runner, d, run, w  # noqa: F401 (fixtures)
from test_bad_input_files import inproc


# ------------------------------------------------------------------------------------------ cleanup

def _site(d, content: bytes, mode=None):
    site = d / "site"
    site.mkdir()
    (site / "usercustomize.py").write_bytes(content)
    if mode is not None:
        os.chmod(site, mode)
    return site


@NEEDS_DAC_DROP
def test_cleanup_in_a_read_only_site_dir(d):
    site = _site(d, b"import os\nimport flash_rl\n", 0o555)
    try:
        check(Case(["cleanup", "--site-dir", site], 1, [str(site / "usercustomize.py"), "cannot write",
                                                         "Permission denied"], [site], no_dac=True), cli_runner)
    finally:
        os.chmod(site, 0o755)


def test_cleanup_on_a_non_utf8_usercustomize(d):
    site = _site(d, b"# \xff\xfe made by hand\nimport flash_rl\n")
    check(Case(["cleanup", "--site-dir", site], 1, [str(site / "usercustomize.py"), "not a text file"], [site]),
          inproc)


def test_cleanup_keeps_a_declared_encoding(d):
    """A usercustomize.py with a coding: line (Python reads it that way) is changed and written back
    in that encoding."""
    site = _site(d, b"# -*- coding: latin-1 -*-\n# caf\xe9\nimport flash_rl\n")
    check(Case(["cleanup", "--site-dir", site], 0, ["disabled `import flash_rl`"], []), inproc)
    assert (site / "usercustomize.py").read_bytes() == b"# -*- coding: latin-1 -*-\n# caf\xe9\n# import flash_rl\n"


# ------------------------------------------------------------------------------------------ verify / setup

def test_verify_overrides_on_a_binary_file(d):
    (d / "blob.bin").write_bytes(b"\x80\x81\xfe\xff" * 64)
    check(Case(["verify", "--config", "bf16", "--verl-overrides", d / "blob.bin"], 1,
               [str(d / "blob.bin"), "not a text (UTF-8) file"], [d]), inproc)


def test_verify_overrides_with_an_unclosed_quote(d):
    (d / "ov.txt").write_text("actor_rollout_ref.model.path='/x\n")
    check(Case(["verify", "--config", "bf16", "--verl-overrides", d / "ov.txt"], 1,
               [str(d / "ov.txt"), "cannot split into words"], [d]), inproc)


DEEP = "[" * 30000 + "]" * 30000


def test_setup_value_nested_30000_deep(d):
    check(Case(["setup", "--fn", "bf16", "-o", d / "c.yaml", f"module_attribute_to_preserve={DEEP}"], 2,
               ["nested too deeply", "60000 characters"], [d]), inproc)


def test_verify_override_nested_30000_deep(d):
    """A value Hydra would keep as a string: read as one, not a RecursionError."""
    from npu_flashrl import verify

    (d / "ov.txt").write_text(f"actor_rollout_ref.rollout.mode=sync\ntrainer.x={DEEP}\n")
    rows = verify.verl_rows(str(d / "ov.txt"), verl="51d2104")
    assert len(rows) == 1 and rows[0]["status"] in ("ok", "warn"), rows  # warn: TIS is off here


# ------------------------------------------------------------------------------------------ pins

BAD_PINS = {
    "yaml_syntax": (b"lines:\n  pinned: {packages: [\n", ["line 3", "malformed YAML"]),
    "binary": (b"\xff\xfe\x00garbage", ["not a text (UTF-8) YAML file"]),
    "package_not_a_mapping": (b"lines:\n  pinned:\n    packages:\n      vllm: 3\n", ["packages.vllm", "expected a mapping"]),
    "env_not_a_mapping": (b"lines:\n  pinned:\n    packages:\n      vllm: {version: '1', env: [a]}\n",
                          ["packages.vllm.env", "expected a mapping"]),
}


@pytest.mark.parametrize("name", sorted(BAD_PINS))
def test_malformed_pins_file(d, name):
    content, needles = BAD_PINS[name]
    pins = d / "pins.yaml"
    pins.write_bytes(content)
    env = cli_env(NPU_FLASHRL_PINS=pins)
    text = check(Case(["verify", "--config", "bf16"], 1, [str(pins), "NPU_FLASHRL_PINS", *needles], [d], env=env),
                 cli_runner)
    assert "pins.yaml" in text
    # the reader install_pinned.sh runs (python npu_flashrl/pins.py lines)
    check(Case(["-m", "npu_flashrl.pins", "lines"], 2, [str(pins), *needles], [d], env=env),
          lambda c: run([sys.executable, *c.argv], env=c.env))


# ------------------------------------------------------------------------------------------ rehearse

def _rehearse(d, *args):
    return Case(["rehearse", *args, "--cache-dir", d / "cache", "--output-dir", d / "out"], None, [],
                [d, d / "cache", d / "out"], cwd=str(d))


def test_rehearse_seq_len_beyond_the_models_positions(d):
    case = _rehearse(d, "--seq-len", "1000")
    case.code, case.needles = 1, ["--seq-len 1000", "512", "max_position_embeddings"]
    check(case, cli_runner)


def test_rehearse_threads_is_bounded(d):
    case = _rehearse(d, "--threads", "100000")
    case.code, case.needles = 2, ["argument --threads", "'100000'", "at most"]
    check(case, cli_runner)


def _qwen2_dir(path, w, shard_bytes: bytes):
    path.mkdir()
    shutil.copy(os.path.join(w.bf16, "config.json"), path / "config.json")
    (path / "model.safetensors").write_bytes(shard_bytes)
    return path


@pytest.mark.parametrize("what", ["empty", "no_tensors", "truncated"])
def test_rehearse_model_with_a_broken_safetensors(w, d, tmp_path, what):
    data = open(os.path.join(w.bf16, "model.safetensors"), "rb").read()
    shard = {"empty": b"", "no_tensors": struct.pack("<Q", 2) + b"{}", "truncated": data[: len(data) // 2]}[what]
    model = _qwen2_dir(tmp_path / "m", w, shard)
    case = _rehearse(d, "--model", model)
    case.code = 1
    case.needles = [f"--model {model}", str(model / "model.safetensors")]
    case.watch.append(model)
    check(case, cli_runner)


# ------------------------------------------------------------------------------------------ profile / W8A8

@NEEDS_DAC_DROP
def test_unreadable_shard_is_not_called_missing_or_corrupt(w, d, tmp_path):
    q = tmp_path / "w8a8"
    shutil.copytree(w.w8a8, q)
    shard = sorted(p for p in os.listdir(q) if p.endswith(".safetensors"))[0]
    os.chmod(q / shard, 0)
    check(Case(["setup", "-m", q, "--fn", "bf16", "-o", d / "c.yaml"], 1,
               [str(q / shard), "cannot open the shard", "Permission denied", "permissions"], [d, q], no_dac=True,
               absent=["No such file", "truncated or corrupt"]), cli_runner)


def test_dangling_shard_symlink_is_named(w, d, tmp_path):
    q = tmp_path / "w8a8"
    shutil.copytree(w.w8a8, q)
    shard = sorted(p for p in os.listdir(q) if p.endswith(".safetensors"))[0]
    os.remove(q / shard)
    os.symlink(tmp_path / "gone.safetensors", q / shard)
    check(Case(["setup", "-m", q, "--fn", "bf16", "-o", d / "c.yaml"], 1,
               [str(q / shard), "dangling symlink"], [d, q], absent=["truncated or corrupt"]), inproc)


def test_profile_with_the_w8a8_checkpoint_twice_blames_m(w, d):
    text = check(Case(["profile", "-m", w.w8a8, "-q", w.w8a8, "-o", d / "p.pt", "--no-progress"], 1,
                      [f"-m {w.w8a8}", "is int8", "-m and -q are the same dir"], [d]), inproc)
    assert "-q" not in text.split("-m and -q")[0].replace(f"-m {w.w8a8}", ""), text


def test_profile_output_over_garbage_does_not_suggest_the_same_path(w, d, tmp_path):
    q = tmp_path / "w8a8"
    shutil.copytree(w.w8a8, q)
    (q / "profile.pt").write_bytes(b"garbage, not a profile")
    text = check(Case(["profile", "-m", w.bf16, "-q", q, "-o", q / "profile.pt", "--no-progress"], 1,
                      [str(q / "profile.pt"), "not a profile; not replaced"], [d, q]), inproc)
    assert f"e.g. {q / 'profile.pt'}" not in text


BAD_SCALES = {"zero": (lambda t: t * 0, "zero"), "nan": (lambda t: t * float("nan"), "NaN"),
              "negative": (lambda t: -t, "negative"), "inf": (lambda t: t * float("inf"), "infinite")}


@pytest.fixture(scope="module")
def bad_scales(w, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("bad_scales")
    out = {}
    for name, (fn, _) in BAD_SCALES.items():
        q = base / name
        shutil.copytree(w.w8a8, q)
        index = json.loads((q / "model.safetensors.index.json").read_text())
        tensor = "model.layers.0.self_attn.k_proj.weight_scale"
        shard = q / index["weight_map"][tensor]
        tensors = load_file(str(shard))
        tensors[tensor] = fn(tensors[tensor])
        save_file(tensors, str(shard), metadata={"format": "pt"})
        out[name] = (str(q), str(shard), tensor)
    return out


@pytest.mark.parametrize("name", sorted(BAD_SCALES))
def test_bad_weight_scale_is_blamed_on_the_checkpoint(w, d, bad_scales, name, capsys):
    q, shard, tensor = bad_scales[name]
    kind = BAD_SCALES[name][1]
    absent = ["was the profile made", "made from another W8A8", "non-positive"]
    check(Case(["profile", "-m", w.bf16, "-q", q, "-o", d / "p.pt", "--no-progress"], 1,
               [shard, tensor, kind, "checkpoint is corrupt"], [d], absent=absent), inproc)
    check(Case(["setup", "-m", q, "-p", w.profile, "--fn", "int8", "-o", d / "c.yaml"], 1,
               [tensor, kind, "checkpoint is corrupt"], [d], absent=absent), inproc)
    cfg = d / "v.yaml"
    cfg.write_text(json.dumps({"configs": [{"fn": "int8", "model": q, "profile": w.profile, "load_format": "auto"}]}))
    text = check(Case(["verify", "--config", cfg], 1, [tensor, kind, "checkpoint is corrupt"], [], absent=absent),
                 inproc)
    assert "all required checks passed" not in text


class Harmless:
    """Any class outside torch's weights_only allow-list (never instantiated by the loader)."""


def test_refused_profile_never_suggests_weights_only_false(w, d):
    evil = d / "evil.pt"
    torch.save({"model.layers.0.self_attn.q_proj.weight": Harmless()}, evil)
    text = check(Case(["setup", "-m", w.w8a8, "-p", evil, "--fn", "int8", "-o", d / "c.yaml"], 1,
                      [str(evil), "refused", "Harmless"], [d], absent=["weights_only=False", "weights_only` set to `False`",
                                                                      "weights_only"]), inproc)
    assert "trust" not in text
