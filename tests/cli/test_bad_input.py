"""Bad-input catalogue: every bad input gets a clear error naming the file, variable, key or
parameter, and nothing is written or changed.

Each case asserts (1) the exit code or exception type, (2) that the message names what is wrong,
(3) that the watched files and directories are byte- and mtime-identical before and after (and
that no file appeared). CLI cases run the real `python -m npu_flashrl.cli` in a subprocess; shell
cases run the real scripts with bash. The wrong-shape reload cases live with the vllm-ascend
adapter's tests.

Stand-ins, by name:
* "unreadable" / "read-only" inputs: tests run as root here, and root ignores file modes, so those
  subprocesses drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from their capability bounding set
  (`cli_env.drop_dac`): the kernel then applies the file modes to them as to any user;
* "base vs Instruct": a second tiny Qwen2 of the same shape from another seed (`other`), and the
  pair's bf16 model with its layernorms moved 10% and its weights 0.5% (`finetuned`);
* a broken torch_npu: a `torch_npu` package on PYTHONPATH whose import raises;
* the recipes' `npu-flashrl` and `python` are scripts that only record that they were started.
"""
import dataclasses
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch
from cli_env import broken_torch_npu, can_drop_dac, cli_env, drop_dac

from npu_flashrl import cli
from npu_flashrl import config as C
from npu_flashrl import profile as P
from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "verl_examples"
FSDP_INT8 = RECIPES / "flash_rl" / "grpo_qwen25_7b_fsdp_int8_A2.sh"
FSDP_CONFIG = RECIPES / "configs" / "test_grpo_qwen25_7b_fsdp_int8_A2.sh"
MEGATRON_CONFIG = RECIPES / "configs" / "test_grpo_qwen25_7b_megatron_int8_A2.sh"
INSTALL = ROOT / "scripts" / "install_pinned.sh"


# ------------------------------------------------------------------------------------------ helpers

def snapshot(*paths) -> Dict[str, tuple]:
    """Every file and dir under `paths`: (kind, size, mtime_ns, sha1). Missing paths are recorded too."""
    out: Dict[str, tuple] = {}
    for top in map(str, paths):
        if not os.path.lexists(top):
            out[top] = ("missing",)
            continue
        entries = [top]
        if os.path.isdir(top) and not os.path.islink(top):
            for d, dirs, files in os.walk(top):
                entries += [os.path.join(d, n) for n in dirs + files]
        for p in entries:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
                out[p] = ("file", st.st_size, st.st_mtime_ns, digest, stat.S_IMODE(st.st_mode))
            else:
                out[p] = ("dir", stat.S_IMODE(st.st_mode))
    return out


def run(argv: List[str], env: Optional[dict] = None, no_dac: bool = False, cwd=None, timeout=180):
    preexec = drop_dac if (no_dac and os.geteuid() == 0) else None
    return subprocess.run(argv, env=env or cli_env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec, cwd=cwd)


def npu_flashrl(*args, env=None, no_dac=False, cwd=None):
    return run([sys.executable, "-m", "npu_flashrl.cli", *map(str, args)], env=env, no_dac=no_dac, cwd=cwd)


@dataclasses.dataclass
class Case:
    argv: List[str]
    code: int
    needles: List[str]              # all must appear in stdout+stderr
    watch: List                     # paths that must not change
    env: Optional[dict] = None
    no_dac: bool = False
    absent: List[str] = dataclasses.field(default_factory=list)  # must NOT appear in the output
    cwd: Optional[str] = None


def check(case: Case, runner: Callable) -> str:
    before = snapshot(*case.watch)
    proc = runner(case)
    text = proc.stdout + proc.stderr
    assert proc.returncode == case.code, f"exit {proc.returncode}, expected {case.code}:\n{text[-3000:]}"
    for needle in case.needles:
        assert needle in text, f"{needle!r} not in the output:\n{text[-3000:]}"
    for needle in case.absent + ["Traceback (most recent call last)"]:
        assert needle not in text, f"{needle!r} in the output:\n{text[-3000:]}"
    assert snapshot(*case.watch) == before, "a watched file or directory changed"
    return text


def cli_runner(case: Case):
    return npu_flashrl(*case.argv, env=case.env, no_dac=case.no_dac, cwd=case.cwd)


def inproc(case: Case):
    """cli.main in this process (the checks need no fresh interpreter; subprocess cases use cli_runner)."""
    import contextlib
    import io
    import types

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in case.argv])
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def bash_runner(case: Case):
    return run(["bash", *map(str, case.argv)], env=case.env, no_dac=case.no_dac, cwd=case.cwd)


# ------------------------------------------------------------------------------------------ fixtures

def _finetune_like(src: str, dst: str, layernorm: float, weights: float, seed: int = 0) -> str:
    """`src` with relative noise on the layernorms and the projections: what separates a base model
    from its Instruct fine-tune (the layernorms move most), or an actor from its start (small drift)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in os.listdir(dst):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(dst, f))
            for k, v in t.items():
                rel = layernorm if "layernorm" in k else weights if k.endswith("proj.weight") else 0.0
                if rel:
                    t[k] = (v.float() * (1 + rel * torch.randn(v.shape, generator=g))).to(v.dtype)
            save_file(t, os.path.join(dst, f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """The shared world: a tiny bf16/W8A8 pair, another model of the same shape, profiles, bad files."""
    base = tmp_path_factory.mktemp("bad_input")
    bf16, w8a8 = tiny_checkpoint_pair(str(base / "pair"))
    other_bf16, other_w8a8 = tiny_checkpoint_pair(str(base / "other"), seed=7)
    ns = dict(base=base, bf16=bf16, w8a8=w8a8, other_bf16=other_bf16, other_w8a8=other_w8a8)
    good = P.compute_int8_profile(bf16, w8a8, progress=False)
    ns["profile"] = P.save_profile(good, str(base / "profile.pt"))
    ns["other_profile"] = P.save_profile(P.compute_int8_profile(other_bf16, other_w8a8, progress=False),
                                         str(base / "other_profile.pt"))
    q = "model.layers.0.self_attn.q_proj.weight"
    ln = "model.layers.1.input_layernorm.weight"
    down = "model.layers.0.mlp.down_proj.weight"
    k = "model.layers.1.self_attn.k_proj.weight"
    bad = {
        "neg_output_scale": (q, "output_scale", lambda t: -t),
        "neg_layernorm_ratio": (ln, "input_scale", lambda t: -t),
        "zero_input_scale": (down, "input_scale", lambda t: t * 0),
        "inf_output_scale": (k, "output_scale", lambda t: t * float("inf")),
    }
    for name, (key, field, fn) in bad.items():
        prof = {n: dict(e) for n, e in good.items()}
        prof[key][field] = fn(prof[key][field])
        path = base / f"{name}.pt"
        torch.save(prof, path)  # torch.save, not save_profile: save_profile refuses these too
        ns[name] = (str(path), key)
    # checkpoints with a damaged shard
    trunc = base / "w8a8_truncated"
    shutil.copytree(w8a8, trunc)
    shard = sorted(p for p in os.listdir(trunc) if p.endswith(".safetensors"))[1]
    data = (trunc / shard).read_bytes()
    (trunc / shard).write_bytes(data[: len(data) // 2])
    ns["truncated"], ns["truncated_shard"] = str(trunc), shard
    corrupt = base / "bf16_corrupt"
    shutil.copytree(bf16, corrupt)
    cshard = sorted(p for p in os.listdir(corrupt) if p.endswith(".safetensors"))[0]
    with open(corrupt / cshard, "r+b") as f:
        f.write(b"\xff" * 16)  # header length and the start of the JSON header
    ns["corrupt"], ns["corrupt_shard"] = str(corrupt), cshard
    ns["finetuned"] = _finetune_like(bf16, str(base / "finetuned"), layernorm=0.1, weights=0.005)
    ns["drifted"] = _finetune_like(bf16, str(base / "drifted"), layernorm=0.0, weights=0.005)
    badindex = base / "w8a8_badindex"
    shutil.copytree(w8a8, badindex)
    (badindex / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["not", "a", "map"]}))
    ns["badindex"] = str(badindex)
    return type("World", (), ns)


@pytest.fixture()
def d(tmp_path):
    """A per-case work dir with a few prepared files."""
    (tmp_path / "verl.yaml").write_text("trainer:\n  total_epochs: 5\nactor_rollout_ref:\n  model: {path: x}\n")
    (tmp_path / "notes.txt").write_text("my notes, not YAML: [\n")
    (tmp_path / "blob.yaml").write_bytes(b"\x80\x81\xfe\xff binary")
    (tmp_path / "flashrl.yaml").write_text("configs:\n- fn: bf16\n  load_format: dummy\n")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "keep.txt").write_text("x")
    os.chmod(tmp_path / "ro", 0o555)
    (tmp_path / "afile").write_text("a file, not a dir")
    yield tmp_path
    os.chmod(tmp_path / "ro", 0o755)


NEEDS_DAC_DROP = pytest.mark.skipif(not can_drop_dac(), reason="cannot drop CAP_DAC_OVERRIDE as root here "
                                    "(no CAP_SETPCAP): file modes cannot be tested")


# ================================================================================== 1. profile pair

PROFILE_CASES = {
    # -m and -q are different models of the same shape (base vs Instruct)
    "pair_mismatch": lambda w, d: Case(
        ["profile", "-m", w.other_bf16, "-q", w.w8a8, "-o", d / "p.pt", "--no-progress"], 1,
        ["model.layers.0.self_attn.q_proj.weight", w.other_bf16, w.w8a8, "not a bf16 model and its W8A8"],
        [d]),
    "pair_mismatch_finetune_like": lambda w, d: Case(  # layernorms 10% off, weights 0.5%
        ["profile", "-m", w.finetuned, "-q", w.w8a8, "-o", d / "p.pt", "--no-progress"], 1,
        ["model.layers.0.self_attn.q_proj.weight", w.finetuned, "relative RMS error"], [d]),
    "pair_mismatch_keeps_old_output": lambda w, d: Case(
        ["profile", "-m", w.other_bf16, "-q", w.w8a8, "-o", d / "flashrl.yaml", "--no-progress"], 1,
        ["model.layers.0.self_attn.q_proj.weight", "relative RMS error"], [d]),
    "q_is_not_w8a8": lambda w, d: Case(
        ["profile", "-m", w.bf16, "-q", w.other_bf16, "-o", d / "p.pt", "--no-progress"], 1,
        [w.other_bf16, "expected int8"], [d]),
    "o_is_a_directory": lambda w, d: Case(
        ["profile", "-m", w.bf16, "-q", w.w8a8, "-o", d / "outdir", "--no-progress"], 1,
        [str(d / "outdir"), "is a directory"], [d]),
    "o_parent_is_a_file": lambda w, d: Case(
        ["profile", "-m", w.bf16, "-q", w.w8a8, "-o", d / "afile" / "p.pt", "--no-progress"], 1,
        [str(d / "afile"), "is not a directory"], [d]),
    "truncated_shard": lambda w, d: Case(
        ["profile", "-m", w.bf16, "-q", w.truncated, "-o", d / "p.pt", "--no-progress"], 1,
        [os.path.join(w.truncated, w.truncated_shard), "truncated or corrupt"], [d, w.truncated]),
    "corrupt_shard": lambda w, d: Case(
        ["profile", "-m", w.corrupt, "-q", w.w8a8, "-o", d / "p.pt", "--no-progress"], 1,
        [os.path.join(w.corrupt, w.corrupt_shard), "unreadable safetensors file"], [d, w.corrupt]),
    "index_not_a_map": lambda w, d: Case(
        ["profile", "-m", w.bf16, "-q", w.badindex, "-o", d / "p.pt", "--no-progress"], 1,
        [os.path.join(w.badindex, "model.safetensors.index.json"), "weight_map"], [d, w.badindex]),
    "m_missing": lambda w, d: Case(
        ["profile", "-m", d / "nope", "-q", w.w8a8, "-o", d / "p.pt", "--no-progress"], 1,
        [str(d / "nope"), "not a directory"], [d]),
    "fn_fp8": lambda w, d: Case(
        ["profile", "-m", w.bf16, "-q", w.w8a8, "-o", d / "p.pt", "--fn", "fp8"], 2, ["--fn fp8"], [d]),
    "no_m": lambda w, d: Case(["profile", "-q", w.w8a8, "-o", d / "p.pt"], 2, ["-m BF16_DIR"], [d]),
    "o_is_a_file_of_the_checkpoint": lambda w, d: Case(  # would have replaced the W8A8 config.json
        ["profile", "-m", w.bf16, "-q", w.w8a8, "-o", os.path.join(w.w8a8, "config.json"), "--no-progress"], 1,
        [os.path.join(w.w8a8, "config.json"), "not a profile; not replaced"], [d, w.w8a8]),
}


@pytest.mark.parametrize("name", sorted(PROFILE_CASES))
def test_profile_refuses(w, d, name):
    check(PROFILE_CASES[name](w, d), cli_runner)


@NEEDS_DAC_DROP
@pytest.mark.parametrize("name", ["read_only_output_dir", "unreadable_shard"])
def test_profile_refuses_unwritable_or_unreadable(w, d, tmp_path, name):
    if name == "read_only_output_dir":
        case = Case(["profile", "-m", w.bf16, "-q", w.w8a8, "-o", d / "ro" / "p.pt", "--no-progress"], 1,
                    [str(d / "ro"), "Permission denied"], [d], no_dac=True)
    else:
        q = tmp_path / "w8a8_unreadable"
        shutil.copytree(w.w8a8, q)
        shard = sorted(p for p in os.listdir(q) if p.endswith(".safetensors"))[0]
        os.chmod(q / shard, 0)
        case = Case(["profile", "-m", w.bf16, "-q", q, "-o", d / "p.pt", "--no-progress"], 1,
                    [str(q / shard)], [d, q], no_dac=True)
    check(case, cli_runner)


def test_pair_check_in_process(w):
    """The library call names the tensor too (ProfileError), and a true pair passes."""
    with pytest.raises(P.ProfileError, match=r"first offending tensor model\.layers\.0\.self_attn\.q_proj\.weight"):
        P.compute_int8_profile(w.other_bf16, w.w8a8, progress=False)
    assert P.check_profile_against_model(P.load_profile(w.profile), w.w8a8) == []
    # the check is about the pair, not a bitwise match: 0.5% weight drift alone still passes
    assert P.compute_int8_profile(w.drifted, w.w8a8, progress=False)


# ================================================================================== 2. setup

def _setup_int8(w, d, profile, out="c.yaml"):
    return ["setup", "-m", w.w8a8, "-p", profile, "--fn", "int8", "-o", d / out]


SETUP_CASES = {
    # profiles setup must refuse: bad scales, made for another model of the same shape
    "profile_negative_output_scale": lambda w, d: Case(
        _setup_int8(w, d, w.neg_output_scale[0]), 1,
        [w.neg_output_scale[0], w.neg_output_scale[1], "output_scale", "non-positive"], [d]),
    "profile_negative_layernorm_ratio": lambda w, d: Case(
        _setup_int8(w, d, w.neg_layernorm_ratio[0]), 1,
        [w.neg_layernorm_ratio[1], "input_scale", "non-positive"], [d]),
    "profile_zero_input_scale": lambda w, d: Case(
        _setup_int8(w, d, w.zero_input_scale[0]), 1, [w.zero_input_scale[1], "non-positive"], [d]),
    "profile_inf_scale": lambda w, d: Case(
        _setup_int8(w, d, w.inf_output_scale[0]), 1, [w.inf_output_scale[1], "non-finite"], [d]),
    "profile_of_another_model_same_shape": lambda w, d: Case(
        _setup_int8(w, d, w.other_profile), 1,
        ["model.layers.0.self_attn.q_proj.weight", "1 / weight_scale", w.w8a8], [d]),
    "profile_is_a_directory": lambda w, d: Case(
        _setup_int8(w, d, d / "outdir"), 1, [str(d / "outdir"), "is a directory"], [d]),
    "profile_not_torch": lambda w, d: Case(
        _setup_int8(w, d, d / "notes.txt"), 1, [str(d / "notes.txt"), "not a readable torch profile"], [d]),
    # -o
    "o_is_a_verl_yaml": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "verl.yaml"], 1,
        [str(d / "verl.yaml"), "not a FlashRL config", "--force"], [d]),
    "o_is_a_text_file": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "notes.txt"], 1, [str(d / "notes.txt"), "--force"], [d]),
    "o_is_binary": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "blob.yaml"], 1, [str(d / "blob.yaml"), "not a text"], [d]),
    "o_is_a_directory": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "outdir"], 1, [str(d / "outdir"), "is a directory"], [d]),
    "o_parent_is_a_file": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "afile" / "c.yaml"], 1, [str(d / "afile"), "not a directory"], [d]),
    "o_checked_before_the_profile": lambda w, d: Case(  # the profile is bad too: -o is reported first
        _setup_int8(w, d, w.neg_output_scale[0], out="outdir"), 1, ["is a directory"], [d],
        absent=["non-positive"]),
    # -a
    "append_to_missing_file": lambda w, d: Case(
        ["setup", "-a", "--fn", "bf16", "-o", d / "new.yaml"], 1, [str(d / "new.yaml"), "does not exist", "drop -a"],
        [d, d / "new.yaml"]),
    "append_to_verl_yaml": lambda w, d: Case(
        ["setup", "-a", "--fn", "bf16", "-o", d / "verl.yaml"], 1, [str(d / "verl.yaml"), "missing key `configs`"], [d]),
    "append_checked_before_the_profile": lambda w, d: Case(
        ["setup", "-a", "-m", w.w8a8, "-p", w.neg_output_scale[0], "-o", d / "verl.yaml"], 1,
        [str(d / "verl.yaml")], [d], absent=["non-positive"]),
    # unknown entry keys
    "unknown_key_load_format_typo": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "c.yaml", "laod_format=dummy"], 2,
        ["'laod_format'", "did you mean 'load_format'", "--force"], [d]),
    "unknown_key_backend_typo": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "c.yaml", "distributed_executor_backnd=ray"], 2,
        ["'distributed_executor_backnd'", "did you mean 'distributed_executor_backend'"], [d]),
    "unknown_key_preserve_typo": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "c.yaml", "module_attributes_to_preserve=['workspace']"], 2,
        ["'module_attributes_to_preserve'", "did you mean 'module_attribute_to_preserve'"], [d]),
    "unknown_key_unrelated": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "c.yaml", "colour=blue"], 2, ["'colour'", "known keys: fn"], [d]),
    "unknown_key_on_append": lambda w, d: Case(
        ["setup", "-a", "--fn", "bf16", "-o", d / "flashrl.yaml", "laod_format=dummy"], 2, ["'laod_format'"], [d]),
    "column_without_key": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-o", d / "c.yaml", "=dummy"], 2, ["'=dummy'", "expected key=value"], [d]),
    "profile_with_fn_bf16": lambda w, d: Case(  # would be ignored silently
        ["setup", "--fn", "bf16", "-p", w.profile, "-o", d / "c.yaml"], 2, [f"-p {w.profile}", "only --fn int8"], [d]),
    "unknown_fn": lambda w, d: Case(["setup", "--fn", "int4", "-o", d / "c.yaml"], 2, ["unknown fn 'int4'"], [d]),
    "model_dir_missing": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-m", d / "nomodel", "-o", d / "c.yaml"], 1, [str(d / "nomodel"), "not found"], [d]),
    "model_dir_without_safetensors": lambda w, d: Case(
        ["setup", "--fn", "bf16", "-m", d / "outdir", "-o", d / "c.yaml"], 1, [str(d / "outdir"), "safetensors"], [d]),
}


@pytest.mark.parametrize("name", sorted(SETUP_CASES))
def test_setup_refuses(w, d, name):
    check(SETUP_CASES[name](w, d), cli_runner)


@NEEDS_DAC_DROP
@pytest.mark.parametrize("name", ["o_in_read_only_dir", "profile_unreadable", "profile_dir_unsearchable",
                                  "config_unreadable_on_append", "model_dir_unreadable"])
def test_setup_refuses_permissions(w, d, tmp_path, name):
    if name == "o_in_read_only_dir":
        # a valid int8 entry: without the early -o check, the whole profile check would run first
        case = Case(_setup_int8(w, d, w.profile, out="ro/c.yaml"), 1, [str(d / "ro"), "Permission denied"], [d],
                    no_dac=True)
    elif name == "profile_unreadable":
        prof = tmp_path / "secret.pt"
        shutil.copy(w.profile, prof)
        os.chmod(prof, 0)
        case = Case(_setup_int8(w, d, prof), 1, [str(prof), "cannot read", "the file exists"], [d, prof],
                    no_dac=True, absent=["not found"])
    elif name == "profile_dir_unsearchable":
        locked = tmp_path / "locked"
        locked.mkdir()
        shutil.copy(w.profile, locked / "profile.pt")
        os.chmod(locked, 0o600)
        case = Case(_setup_int8(w, d, locked / "profile.pt"), 1, [str(locked / "profile.pt"), "cannot access"],
                    [d], no_dac=True, absent=["not found"])
    elif name == "config_unreadable_on_append":
        cfg = d / "flashrl.yaml"
        os.chmod(cfg, 0)
        case = Case(["setup", "-a", "--fn", "bf16", "-o", cfg], 1, [str(cfg), "cannot read", "permissions"], [d],
                    no_dac=True)
    else:
        model = tmp_path / "model"
        shutil.copytree(w.bf16, model)
        os.chmod(model, 0o300)
        case = Case(["setup", "--fn", "bf16", "-m", model, "-o", d / "c.yaml"], 1, [str(model), "cannot list"],
                    [d], no_dac=True)
    try:
        check(case, cli_runner)
    finally:
        for p in tmp_path.rglob("*"):
            os.chmod(p, 0o755)


def test_setup_force_replaces_a_foreign_file(d):
    """The positive side of `o_is_a_verl_yaml`: --force is the way through."""
    proc = npu_flashrl("setup", "--fn", "bf16", "--force", "-o", d / "verl.yaml")
    assert proc.returncode == 0, proc.stderr
    assert C.load_config(str(d / "verl.yaml")).entries[0].fn == "bf16"


def test_concurrent_appends_keep_every_entry(d):
    """Real concurrent `setup -a` processes on one file: the fcntl lock keeps every entry (before the
    lock, entries were lost while every process exited 0) and the atomic replace leaves no temp file."""
    cfg = d / "flashrl.yaml"
    n = 6
    env = cli_env()
    procs = [subprocess.Popen([sys.executable, "-m", "npu_flashrl.cli", "setup", "-a", "--fn", "bf16", "--no-check",
                               "-o", str(cfg), f"module_attribute_to_preserve=['w{i}']"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    results = [(p.wait(timeout=180), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert all(code == 0 for code, _ in results), results
    entries = C.load_config(str(cfg)).entries
    assert len(entries) == 1 + n
    assert sorted(e.extra["module_attribute_to_preserve"][0] for e in entries[1:]) == [f"w{i}" for i in range(n)]
    assert not [f for f in os.listdir(d) if f.endswith(".tmp")]


# ================================================================================== 3. verify

def _flashrl_cfg(d, entry: dict, name="v.yaml") -> str:
    path = d / name
    path.write_text(json.dumps({"configs": [entry]}))  # JSON is YAML
    return str(path)


VERIFY_CASES = {
    "profile_negative_scale": lambda w, d: (
        _flashrl_cfg(d, {"fn": "int8", "model": w.w8a8, "profile": w.neg_output_scale[0]}),
        [w.neg_output_scale[1], "non-positive"]),
    "profile_of_another_model_same_shape": lambda w, d: (
        _flashrl_cfg(d, {"fn": "int8", "model": w.w8a8, "profile": w.other_profile}),
        ["model.layers.0.self_attn.q_proj.weight", "1 / weight_scale"]),
    "unknown_key": lambda w, d: (
        _flashrl_cfg(d, {"fn": "bf16", "laod_format": "dummy"}), ["'laod_format'", "did you mean 'load_format'"]),
    "model_with_truncated_shard": lambda w, d: (
        _flashrl_cfg(d, {"fn": "int8", "model": w.truncated, "profile": w.profile}),
        [os.path.join(w.truncated, w.truncated_shard)]),
    "config_is_binary": lambda w, d: (str(d / "blob.yaml"), [str(d / "blob.yaml"), "not a text"]),
    "config_is_a_directory": lambda w, d: (str(d / "outdir"), [str(d / "outdir"), "is a directory"]),
}


@pytest.mark.parametrize("name", sorted(VERIFY_CASES))
def test_verify_fails(w, d, name, capsys):
    """In process (verify's config rows need no fresh interpreter; the env cases below do)."""
    cfg, needles = VERIFY_CASES[name](w, d)
    before = snapshot(d, w.truncated)
    assert cli.main(["verify", "--config", cfg]) == 1
    out = capsys.readouterr().out
    for needle in needles:
        assert needle in out, out
    assert "all required checks passed" not in out and "FAIL" in out
    assert snapshot(d, w.truncated) == before


VERIFY_ENV_CASES = {
    # FLASHRL_CONFIG is fine but activation at import fails: verify must not say all is well
    "activation_failed_lmhead_value": lambda d: Case(
        ["verify"], 1, ["activation from FLASHRL_CONFIG failed", "FLASHRL_LMHEAD_FP32='maybe'"], [d],
        env=cli_env(FLASHRL_CONFIG="bf16", FLASHRL_LMHEAD_FP32="maybe"), absent=["all required checks passed"]),
    "apply_patches_with_broken_torch_npu": lambda d: Case(
        ["verify", "--apply-patches"], 1, ["`import torch_npu` fails", "applying it failed", "libascendcl.so",
                                           "fix: install the pinned torch_npu"],
        [d], env=cli_env(PYTHONPATH=os.pathsep.join([broken_torch_npu(d), str(ROOT)])),
        absent=["all required checks passed"]),
    "apply_patches_without_torch_npu": lambda d: Case(
        ["verify", "--apply-patches"], 1, ["applying it failed", "No module named 'torch_npu'",
                                           "fix: install the pinned torch_npu"],
        [d], absent=["all required checks passed"]),
}


@pytest.mark.parametrize("name", sorted(VERIFY_ENV_CASES))
def test_verify_env_fails(d, name):
    if name == "apply_patches_without_torch_npu":
        import importlib.util

        if importlib.util.find_spec("torch_npu") is not None:
            pytest.skip("a torch_npu is installed in this environment")
    check(VERIFY_ENV_CASES[name](d), cli_runner)


@NEEDS_DAC_DROP
def test_verify_config_in_unsearchable_dir_is_not_missing(d, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "c.yaml").write_text("configs:\n- fn: bf16\n")
    os.chmod(locked, 0o600)
    try:
        check(Case(["verify", "--config", locked / "c.yaml"], 1, [str(locked / "c.yaml"), "cannot access"], [d],
                   no_dac=True, absent=["no such file"]), cli_runner)
    finally:
        os.chmod(locked, 0o755)


# ================================================================================== 4. environment

@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "1.0"])
def test_lmhead_fp32_bad_value_is_refused(value, monkeypatch):
    monkeypatch.setenv("FLASHRL_LMHEAD_FP32", value)
    with pytest.raises(C.ConfigError, match=f"FLASHRL_LMHEAD_FP32={value!r}"):
        C.lmhead_fp32_requested()
    # activation refuses it too, before any patch is applied
    from npu_flashrl import activation, patches

    def applied():
        return {p["name"] for p in patches.status() if p["applied"]}

    before = applied()
    with pytest.raises(C.ConfigError, match="FLASHRL_LMHEAD_FP32"):
        activation.activate("bf16")
    assert applied() == before  # activation may import (register) adapters, never apply one


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("true", True), ("TRUE", True), (" on ", True),
                                      ("0", False), ("no", False), ("false", False), ("off", False), ("", False)])
def test_lmhead_fp32_spellings(value, on):
    """`yes` and `true` used to be silently off."""
    assert C.lmhead_fp32_requested({"FLASHRL_LMHEAD_FP32": value}) is on


@pytest.mark.parametrize("name", ["missing_dir", "a_directory"])
def test_logging_file_falls_back_to_stderr(d, name):
    target = d / "nodir" / "x.log" if name == "missing_dir" else d / "outdir"
    case = Case(["setup", "--fn", "bf16", "-o", d / "c.yaml"], 0,
                ["FLASHRL_LOGGING_FILE=", str(target), "logging to stderr", "written to"],
                [d / "nodir", d / "outdir"], env=cli_env(FLASHRL_LOGGING_FILE=target))
    check(case, cli_runner)  # the command itself still works


def test_logging_file_bad_keeps_activating(d):
    """Activation at import with a bad FLASHRL_LOGGING_FILE still happens (emulated torch_npu, CPU harness)."""
    code = textwrap.dedent("""
        import importlib, os
        from npu_flashrl.sim import cpu_vllm
        cpu_vllm.prepare_process()
        os.environ["FLASHRL_CONFIG"] = "bf16"
        import npu_flashrl
        importlib.reload(npu_flashrl)  # activation at import, now that the harness is in place
        assert npu_flashrl.activation_error is None, npu_flashrl.activation_error
        from npu_flashrl import activation
        assert activation.active_config() is not None
        print("ACTIVE")
    """)
    env = cli_env(FLASHRL_LOGGING_FILE=d / "nodir" / "x.log")
    case = Case(["-c", code], 0, ["ACTIVE", "FLASHRL_LOGGING_FILE=", "logging to stderr"], [d / "nodir"], env=env)
    check(case, lambda c: run([sys.executable, *c.argv], env=c.env))


# ================================================================================== 5. rehearse

REHEARSE_CASES = {
    "max_error_nan": (["--max-error", "nan"], "--max-error"),
    "max_error_inf": (["--max-error", "inf"], "--max-error"),
    "max_error_below_one": (["--max-error", "0.5"], "--max-error"),
    "max_error_word": (["--max-error", "tight"], "--max-error"),
    "max_layer_error_nan": (["--max-layer-error", "nan"], "--max-layer-error"),
    "baseline_tol_negative": (["--baseline-tol", "-0.1"], "--baseline-tol"),
    "steps_zero": (["--steps", "0"], "--steps"),
    "steps_word": (["--steps", "two"], "--steps"),
    "seq_len_one": (["--seq-len", "1"], "--seq-len"),
    "step_lr_zero": (["--step-lr", "0"], "--step-lr"),
    "threads_zero": (["--threads", "0"], "--threads"),
}


@pytest.mark.parametrize("flag", ["--output-dir", "--cache-dir"])
def test_rehearse_dirs_that_are_files_are_refused_up_front(d, flag):
    """Found before pre-training, one line (it was a raw NotADirectoryError after the model was built)."""
    check(Case(["rehearse", flag, d / "afile"], 1, [f"{flag} {d / 'afile'}", "not a directory"], [d], cwd=str(d)),
          cli_runner)


@pytest.mark.parametrize("name", sorted(REHEARSE_CASES))
def test_rehearse_usage_errors_exit_2_before_running(d, name):
    args, flag = REHEARSE_CASES[name]
    check(Case(["rehearse", *args, "--cache-dir", d / "cache"], 2, [f"argument {flag}"],
               [d, d / "cache", d / "rehearsal_out"], cwd=str(d)), cli_runner)


@pytest.mark.parametrize("args", [["--max-error", "1.0"], ["--baseline-tol", "0.5"], ["--num-seqs", "4"],
                                  ["--seq-len", "16"], ["--inner-iters", "3"]], ids=lambda a: a[0])
def test_rehearse_grpo_refuses_options_it_would_ignore(d, args, monkeypatch):
    """--grpo has its own checks: a weight-path option given with it was ignored without a word, so
    `--max-error 1.0` read as a limit that held while the run's error was 1.0157. In process: the
    refusal comes before anything is built."""
    monkeypatch.chdir(d)
    text = check(Case(["rehearse", "--grpo", *args, "--cache-dir", d / "cache", "--output-dir", d / "out"], 2,
                      [f"{args[0]} {args[1]}", "not a --grpo option", f"Drop {args[0]}"], [d]), inproc)
    assert text.count("error:") == 1


# ================================================================================== 6. recipes

@pytest.fixture()
def recipe(tmp_path):
    """Inputs of the recipes; `npu-flashrl` and `python` are stand-ins that record being started."""
    model = tmp_path / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "models" / "Qwen2.5-7B-Instruct-W8A8").mkdir()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.parquet").write_bytes(b"")
    (data / "test.parquet").write_bytes(b"")
    marker = tmp_path / "started"
    fake = tmp_path / "bin" / "fake"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marker}\n")
    fake.chmod(0o755)
    # the recipes' interpreter runs npu_flashrl's preflight for real; anything else it would start is recorded
    python = tmp_path / "bin" / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$1 $2\" = \"-m npu_flashrl.recipes.preflight\" ]; then exec {sys.executable} \"$@\"; fi\n"
                      f"echo \"$0 $*\" >> {marker}\n")
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "NPU_FLASHRL", "RAY_"))}
    env.update(HOME=str(tmp_path / "home"), MODEL_PATH=str(model), DATA_DIR=str(data), RUN_DIR=str(tmp_path / "run"),
               NPU_FLASHRL_CLI=str(fake), PYTHON=str(python), ROLLOUT_PRECISION="bf16")
    return {"tmp": tmp_path, "env": env, "marker": marker, "run": tmp_path / "run"}


RECIPE_CASES = {
    # (script, args, extra env, exit code, needles)
    "entry_dryrun_typo": (FSDP_INT8, ["--dryrun"], {}, 2, ["unknown option '--dryrun'"]),
    "entry_single_dash": (FSDP_INT8, ["-x"], {}, 2, ["unknown option '-x'"]),
    "config_dryrun_typo": (FSDP_CONFIG, ["--dryrun"], {}, 2, ["unknown option '--dryrun'"]),
    "config_hydra_flag": (FSDP_CONFIG, ["--config-name=other"], {}, 2, ["unknown option '--config-name=other'"]),
    "megatron_typo_after_override": (MEGATRON_CONFIG, ["trainer.total_epochs=1", "--dry_run"], {}, 2,
                                     ["unknown option '--dry_run'"]),
    "entry_npus_8x": (FSDP_INT8, [], {"NPUS_PER_NODE": "8x"}, 1, ["NPUS_PER_NODE", "'8x'"]),
    "entry_npus_eight": (FSDP_INT8, [], {"NPUS_PER_NODE": "eight"}, 1, ["NPUS_PER_NODE", "'eight'"]),
    "entry_response_len_10k": (FSDP_INT8, [], {"MAX_RESPONSE_LENGTH": "10k"}, 1, ["MAX_RESPONSE_LENGTH", "'10k'"]),
    "config_npus_8x": (FSDP_CONFIG, [], {"NPUS_PER_NODE": "8x"}, 1, ["NPUS_PER_NODE", "'8x'"]),
    "config_nnodes_octal": (FSDP_CONFIG, [], {"NNODES": "08"}, 1, ["NNODES", "'08'"]),
    "config_rollout_tp_zero": (FSDP_CONFIG, [], {"ROLLOUT_TP": "0"}, 1, ["ROLLOUT_TP", ">= 1"]),
    "config_prompt_len_word": (FSDP_CONFIG, [], {"MAX_PROMPT_LENGTH": "long"}, 1, ["MAX_PROMPT_LENGTH", "'long'"]),
    "config_lr_word": (FSDP_CONFIG, [], {"LR": "fast"}, 1, ["LR must be", "'fast'"]),
    "config_gpu_mem_above_one": (FSDP_CONFIG, [], {"GPU_MEMORY_UTILIZATION": "1.5"}, 1, ["GPU_MEMORY_UTILIZATION"]),
    "config_save_freq_word": (FSDP_CONFIG, [], {"SAVE_FREQ": "never"}, 1, ["SAVE_FREQ", "'never'"]),
    "megatron_train_tp_word": (MEGATRON_CONFIG, [], {"TRAIN_TP": "four"}, 1, ["TRAIN_TP", "'four'"]),
}


@pytest.mark.parametrize("name", sorted(RECIPE_CASES))
def test_recipe_refuses_before_anything_runs(recipe, name):
    script, args, extra, code, needles = RECIPE_CASES[name]
    env = dict(recipe["env"], **extra)
    # not a dry run: before the fix a typo'd flag launched the real job
    check(Case([script, *args], code, needles, [recipe["tmp"] / "models", recipe["marker"], recipe["run"]], env=env),
          bash_runner)


# ================================================================================== 7. install_pinned.sh

def _install_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_REPO_URL")}
    env.pop("NPU_FLASHRL_PINS", None)
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", PYTHON=sys.executable, MIN_FREE_GB="0",
               ASCEND_HOME=str(tmp_path / "Ascend"))
    env.update(extra)
    return env


INSTALL_CASES = {
    "only_unknown": (["--dry-run", "--only", "vlm"], 2, ["unknown component 'vlm'", "vllm_ascend"]),
    "only_one_unknown_of_two": (["--dry-run", "--only", "verl,torch-npu"], 2, ["unknown component 'torch-npu'"]),
    "only_unknown_real_run": (["--only", "everything"], 2, ["unknown component 'everything'"]),
    "log_is_a_directory": (["--log", "{d}/outdir"], 1, ["LOG_FILE", "{d}/outdir"]),
    "log_parent_is_a_file": (["--dry-run", "--log", "{d}/afile/x.log"], 1, ["LOG_FILE", "{d}/afile"]),
    "workdir_parent_is_a_file": (["--dry-run", "--workdir", "{d}/afile/wd"], 1, ["WORKDIR", "{d}/afile"]),
}


@pytest.mark.parametrize("name", sorted(INSTALL_CASES))
def test_install_pinned_refuses(d, name):
    args, code, needles = INSTALL_CASES[name]
    args = [a.replace("{d}", str(d)) for a in args]
    if "--workdir" not in args:
        args += ["--workdir", str(d / "wd")]
    check(Case([INSTALL, *args], code, [n.replace("{d}", str(d)) for n in needles], [d, d / "wd"],
               env=_install_env(d)), bash_runner)


@NEEDS_DAC_DROP
@pytest.mark.parametrize("name", ["dry_run_workdir_read_only", "dry_run_log_read_only", "real_run_log_read_only"])
def test_install_pinned_refuses_unwritable(d, name):
    if name == "dry_run_workdir_read_only":
        args, needles = ["--dry-run", "--workdir", d / "ro" / "wd"], ["WORKDIR", str(d / "ro")]
    elif name == "dry_run_log_read_only":
        args, needles = ["--dry-run", "--workdir", d / "wd", "--log", d / "ro" / "x.log"], ["LOG_FILE", str(d / "ro")]
    else:
        args, needles = ["--workdir", d / "wd", "--log", d / "ro" / "x.log"], ["LOG_FILE", str(d / "ro")]
    check(Case([INSTALL, *args], 1, needles, [d, d / "wd"], env=_install_env(d), no_dac=True), bash_runner)


# ================================================================================== 9. Ray

def test_serves_the_policy_never_starts_ray():
    """`serves_the_policy()` runs in every vLLM engine built with verl's worker extension, also one
    built outside Ray. Ray's API auto-initialises (`ray.init()`) a process that is not connected, so
    asking it there would start a local Ray instance. In a fresh process where ray is importable:
    (1) ray not imported: the check must not import it; (2) ray imported, not initialised: the check
    must not call `ray.init`. Spies, by name: a meta-path finder that refuses `import ray` and
    records it, and `ray.init` replaced by a recorder that refuses (so a failing run starts no real
    Ray instance on the test machine)."""
    code = textwrap.dedent("""
        import importlib.util
        import sys

        assert importlib.util.find_spec("ray") is not None, "ray is not importable here"
        from npu_flashrl.adapters.verl import server_mode

        imported = []

        class RefuseRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    imported.append(name)
                    raise ImportError("spy: the check imported ray")
                return None

        sys.meta_path.insert(0, RefuseRay())
        assert "ray" not in sys.modules
        first = server_mode.serves_the_policy()
        sys.meta_path.pop(0)

        import ray
        started = []

        def init(*args, **kwargs):
            started.append(1)
            raise RuntimeError("spy: ray.init refused")

        ray.init = init
        second = server_mode.serves_the_policy()
        print("RESULT", first, second, "imports", len(imported), "inits", len(started),
              "initialized", ray.is_initialized())
    """)
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT True True imports 0 inits 0 initialized False" in proc.stdout, proc.stdout + proc.stderr
