"""int8 profile: equal to FlashRL 1.0.3's `profiling_int8`, computed per layer, validated on load."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from npu_flashrl import profile as P
from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair


def _require_compressed_tensors():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"compressed-tensors cannot be imported ({exc}); it is installed with --no-deps: "
                    f"add its dependency (frozendict) to requirements/cpu-stack-<line>.txt [deps]")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    _require_compressed_tensors()
    return tiny_checkpoint_pair(str(tmp_path_factory.mktemp("pair")))


# FlashRL's profiler, run unchanged in a fresh process (its import configures the ROOT logger).
# It calls no CUDA. transformers needs `accelerate` for its device_map="cpu" and for loading a
# compressed-tensors checkpoint at all.
_FLASHRL_RUNNER = textwrap.dedent("""
    import sys
    import flash_rl.flash_quantization as fq
    fq.profiling_int8(sys.argv[1], sys.argv[2], sys.argv[3])
""")


@pytest.fixture(scope="module")
def flashrl_profile(ckpts, tmp_path_factory):
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("accelerate is not installed: transformers needs it to load the W8A8 checkpoint "
                    "for FlashRL's profiler; add accelerate to requirements/cpu-stack-<line>.txt [deps]")
    bf16, w8a8 = ckpts
    out = str(tmp_path_factory.mktemp("ref") / "flashrl_profile.pt")
    env = dict(os.environ, VLLM_PLUGINS="none", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("FLASHRL_CONFIG", None)
    res = subprocess.run([sys.executable, "-c", _FLASHRL_RUNNER, bf16, w8a8, out],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def test_equals_flashrl_profiling_int8(ckpts, flashrl_profile):
    bf16, w8a8 = ckpts
    ours = P.compute_int8_profile(bf16, w8a8, progress=False)
    ref = torch.load(flashrl_profile, weights_only=False)
    # our loader/validator accepts FlashRL's own files, and they fit the model
    assert list(P.load_profile(flashrl_profile)) == list(ref)
    assert P.check_profile_against_model(ref, w8a8) == []
    assert list(ours) == list(ref)  # same keys, same order
    for name, entry in ref.items():
        assert set(ours[name]) == set(entry) == {"input_scale", "output_scale", "type"}
        for field in ("input_scale", "output_scale"):
            a, b = entry[field], ours[name][field]
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor), (name, field)
                assert a.dtype == b.dtype and a.shape == b.shape, (name, field)
                assert torch.equal(a.detach(), b), (name, field, (a.detach() - b).abs().max())
            else:
                assert type(a) is type(b) and a == b, (name, field)
        if entry["type"] == torch.int8:
            assert ours[name]["type"] == torch.int8
        else:
            # layernorms: ours is the W8A8 checkpoint's dtype; FlashRL reports the dtype transformers
            # loaded the quantized model in (float16 when no dtype is given)
            assert ours[name]["type"] == torch.bfloat16
            assert entry["type"].is_floating_point


def test_profile_is_not_trivial_and_has_flashrl_meaning(ckpts):
    """The smoothing in the test checkpoint makes every FlashRL term matter, and the profile maps the
    bf16 weights onto the checkpoint's int8 grid."""
    from safetensors import safe_open

    bf16, w8a8 = ckpts
    prof = P.compute_int8_profile(bf16, w8a8, progress=False)
    ln = prof["model.layers.0.input_layernorm.weight"]["input_scale"]
    assert (ln - 1).abs().max() > 0.05
    beta_inv = prof["model.layers.0.mlp.down_proj.weight"]["input_scale"]
    assert beta_inv.shape == (1, 352) and (beta_inv - 1).abs().max() > 0.05
    assert prof["model.layers.0.self_attn.o_proj.weight"]["input_scale"] == 1.0

    def tensor(d, n):
        idx = P.SafetensorsCheckpoint(d)
        try:
            return idx.get(n)
        finally:
            idx.close()

    for proj in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"):
        name = f"model.layers.1.{proj}.weight"
        e = prof[name]
        w = tensor(bf16, name).float()
        q = torch.round(w * e["output_scale"] * e["input_scale"]).clamp(-128, 127)
        ref = tensor(w8a8, name).float()
        agree = (q == ref).float().mean().item()
        off = (q - ref).abs().max().item()
        # smoothed weights and layernorms were rounded to bf16 in the checkpoint: off-by-one
        assert agree > 0.8 and off <= 2, (proj, agree, off)
        if proj != "self_attn.o_proj":  # without the input term the grid is clearly missed
            naive = torch.round(w * e["output_scale"]).clamp(-128, 127)
            assert (naive == ref).float().mean().item() < agree - 0.2, proj


def test_reads_one_layer_at_a_time(ckpts, monkeypatch):
    bf16, w8a8 = ckpts
    loaded = []
    real_get = P.SafetensorsCheckpoint.get

    def spy(self, name):
        loaded.append((self.dir, name))
        return real_get(self, name)

    monkeypatch.setattr(P.SafetensorsCheckpoint, "get", spy)
    P.compute_int8_profile(bf16, w8a8, progress=False)
    bf16_weights = {n for d, n in loaded if d == bf16 and n.endswith("proj.weight")}
    # every projection: up_proj for the least squares, all of them for the pair check
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert bf16_weights == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in projections}
    assert not any("embed_tokens" in n or "lm_head" in n for _, n in loaded)
    layers = [int(n.split(".")[2]) for _, n in loaded if ".layers." in n]
    assert layers == sorted(layers)  # layer by layer, never revisiting


def test_progress_bar(ckpts, capsys):
    bf16, w8a8 = ckpts
    P.compute_int8_profile(bf16, w8a8, progress=True)
    assert "npu-flashrl profile (int8)" in capsys.readouterr().err


def test_save_load_roundtrip_and_flashrl_loader(ckpts, tmp_path):
    bf16, w8a8 = ckpts
    out = str(tmp_path / "p.pt")
    prof = P.make_profile(bf16, w8a8, out, progress=False)
    back = P.load_profile(out)
    assert list(back) == list(prof)
    assert torch.equal(back["model.layers.1.mlp.up_proj.weight"]["output_scale"],
                       prof["model.layers.1.mlp.up_proj.weight"]["output_scale"])
    # FlashRL's loader is plain torch.load(path) (vllm_patch.patch_vllm_llm)
    assert set(torch.load(out)) == set(prof)


def test_failed_profile_leaves_output_untouched(ckpts, tmp_path):
    bf16, w8a8 = ckpts
    out = tmp_path / "p.pt"
    out.write_bytes(b"previous")
    with pytest.raises(P.ProfileError, match="expected int8"):
        P.make_profile(bf16, bf16, str(out), progress=False)   # -q is not a W8A8 checkpoint
    assert out.read_bytes() == b"previous"
    with pytest.raises(P.ProfileError, match="only int8"):
        P.make_profile(bf16, w8a8, str(out), fn="fp8")
    assert out.read_bytes() == b"previous" and os.listdir(tmp_path) == ["p.pt"]


def test_bad_checkpoint_dirs(ckpts, tmp_path):
    bf16, w8a8 = ckpts
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(P.ProfileError, match=r"empty: no \*\.safetensors files"):
        P.compute_int8_profile(str(empty), w8a8, progress=False)
    with pytest.raises(P.ProfileError, match="not a directory"):
        P.compute_int8_profile(str(tmp_path / "missing"), w8a8, progress=False)
    # W8A8 checkpoint with a layer's scale missing
    broken = tmp_path / "broken"
    shutil.copytree(w8a8, broken)
    idx = json.loads((broken / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.layers.1.mlp.down_proj.weight_scale"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(P.ProfileError, match="model.layers.1.mlp.down_proj.weight_scale"):
        P.compute_int8_profile(bf16, str(broken), progress=False)


def test_load_profile_errors(tmp_path, ckpts):
    bf16, w8a8 = ckpts
    with pytest.raises(P.ProfileError, match="nope.pt: profile not found"):
        P.load_profile(str(tmp_path / "nope.pt"))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(P.ProfileError, match="garbage.pt: not a readable torch profile"):
        P.load_profile(str(garbage))
    fp8 = tmp_path / "fp8.pt"
    torch.save(["model.layers.0.self_attn.q_proj.weight"], fp8)
    with pytest.raises(P.ProfileError, match="fp8.pt: .*fp8 profile is a list"):
        P.load_profile(str(fp8))
    good = P.compute_int8_profile(bf16, w8a8, progress=False)
    name = "model.layers.0.self_attn.k_proj.weight"
    nan = dict(good)
    nan[name] = dict(good[name], output_scale=good[name]["output_scale"] * float("nan"))
    torch.save(nan, tmp_path / "nan.pt")
    with pytest.raises(P.ProfileError, match=f"nan.pt: entry '{name}' output_scale: .*non-finite"):
        P.load_profile(str(tmp_path / "nan.pt"))
    missing_field = dict(good)
    missing_field[name] = {"input_scale": 1.0, "type": torch.int8}
    torch.save(missing_field, tmp_path / "mf.pt")
    with pytest.raises(P.ProfileError, match=f"mf.pt: entry '{name}' must be a dict with keys"):
        P.load_profile(str(tmp_path / "mf.pt"))
    transposed = dict(good)
    transposed[name] = dict(good[name], output_scale=good[name]["output_scale"].view(1, -1))
    torch.save(transposed, tmp_path / "t.pt")
    with pytest.raises(P.ProfileError, match="expected \\[out_features, 1\\]"):
        P.load_profile(str(tmp_path / "t.pt"))


def test_check_profile_against_model(ckpts, tmp_path):
    bf16, w8a8 = ckpts
    prof = P.compute_int8_profile(bf16, w8a8, progress=False)
    assert P.check_profile_against_model(prof, w8a8) == []
    assert P.check_profile_against_model(prof, bf16) == []
    # a profile made for another model: different MLP width and one more layer
    other_bf16, other_w8a8 = tiny_checkpoint_pair(str(tmp_path / "other"), seed=1,
                                                  config_overrides={"intermediate_size": 320,
                                                                    "num_hidden_layers": 3})
    offenders = P.check_profile_against_model(prof, other_w8a8, limit=50)
    assert any(o.startswith("model.layers.0.mlp.gate_proj.weight: profile output_scale [352, 1]")
               for o in offenders), offenders
    assert any(o.startswith("model.layers.0.mlp.down_proj.weight: profile input_scale [1, 352]")
               for o in offenders), offenders
    assert any(o.startswith("model.layers.2.self_attn.q_proj.weight: in ") and "not in the profile" in o
               for o in offenders), offenders
    assert len(P.check_profile_against_model(prof, other_w8a8, limit=3)) == 3
    partial = {k: v for k, v in prof.items() if ".layers.1." not in k}
    assert any("model.layers.1." in o and "not in the profile" in o
               for o in P.check_profile_against_model(partial, w8a8))
    renamed = {k.replace("model.", "transformer.", 1): v for k, v in prof.items()}
    assert P.check_profile_against_model(renamed, w8a8)[0].endswith(f"in the profile but not in {w8a8}")
