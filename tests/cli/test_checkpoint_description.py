"""A quantized checkpoint's description, per layer / group, refused by name before launch:
`npu-flashrl setup`, `verify` and the recipes' preflight, on tiny ModelSlim and compressed-tensors
checkpoints written here (headers read, never the tensors).

Stand-ins: none for the checks themselves (npu_flashrl's scheme registry, the safetensors headers,
the engine's own compressed-tensors translation). This process has no vllm-ascend importable (no
torch_npu, no emulation installed here), so the installed line's scheme table is not read and the
refusals come from npu_flashrl's registry, with a note saying so; the table's verdict is
tests/adapters/vllm_ascend/test_description_registry.py's.
"""
import json
import os
import shutil

import pytest
import yaml

from npu_flashrl import cli
from npu_flashrl.recipes import preflight as P
from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

Q_PROJ = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from modelslim_writer import write_modelslim_w8a8

    root = tmp_path_factory.mktemp("desc")
    bf16, w8a8 = tiny_checkpoint_pair(str(root / "pair"))
    ms = str(root / "modelslim")
    write_modelslim_w8a8(bf16, ms)
    return {"bf16": bf16, "ct": w8a8, "ms": ms}


def _copy(src, dst, description=None, tensors=None, quant_config=None):
    """A copy of checkpoint `src` with description entries / tensors / quantization_config changed."""
    shutil.copytree(src, dst)
    if description:
        path = os.path.join(dst, "quant_model_description.json")
        with open(path) as f:
            desc = json.load(f)
        desc.update(description)
        with open(path, "w") as f:
            json.dump(desc, f)
    if tensors:
        from safetensors.torch import load_file, save_file

        path = os.path.join(dst, "model.safetensors")
        data = load_file(path)
        for name, change in tensors.items():
            data[name] = change(data[name])
        save_file(data, path)
    if quant_config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        quant_config(cfg["quantization_config"])
        with open(path, "w") as f:
            json.dump(cfg, f)
    return str(dst)


def _setup_refuses(model, out, capsys, needles, fn="int8_profile_free"):
    assert cli.main(["setup", "--fn", fn, "-m", model, "-o", str(out)]) != 0
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not os.path.exists(out)
    return err


def _group(cfg):
    return cfg["config_groups"]["group_0"]


BAD = {  # label: (how the copy differs from the good checkpoint, words the refusal must hold)
    "w8a16": ("ms", {"description": {f"{DOWN}.weight": "W8A16"}},
              [f"layer {DOWN}", "'W8A16'", "W8A8_DYNAMIC/linear", "W8A8/linear"]),
    "unknown": ("ms", {"description": {f"{DOWN}.weight": "W3A5_MAGIC"}}, [f"layer {DOWN}", "'W3A5_MAGIC'"]),
    "float_int8": ("ms", {"description": {f"{Q_PROJ}.weight": "FLOAT"}},
                   [f"layer {Q_PROJ} is typed FLOAT", "int8", "garbage"]),
    "weight_not_int8": ("ms", {"tensors": {f"{Q_PROJ}.weight": lambda t: t.bfloat16()}},
                        [f"layer {Q_PROJ} is typed W8A8", "is BF16, expected int8"]),
    "scale_shape": ("ms", {"tensors": {f"{Q_PROJ}.weight_scale": lambda t: t.repeat(1, 2)}},
                    [f"{Q_PROJ}.weight_scale has shape", "expected ["]),
    "ct_4bit": ("ct", {"quant_config": lambda q: _group(q)["weights"].update(num_bits=4)},
                ["config_groups.group_0.weights.num_bits = 4"]),
    "ct_weight_only": ("ct", {"quant_config": lambda q: _group(q).update(input_activations=None)},
                       ["config_groups.group_0.input_activations.num_bits = None"]),
}


def _bad_copy(dirs, label, dst):
    base, change, _ = BAD[label]
    return _copy(dirs[base], dst, **change)


@pytest.mark.parametrize("label", sorted(BAD))
def test_setup_and_verify_refuse_the_layer_or_group(dirs, label, tmp_path, capsys, monkeypatch):
    model = _bad_copy(dirs, label, tmp_path / "bad")
    needles = BAD[label][2]
    _setup_refuses(model, tmp_path / "c.yaml", capsys, needles + ["nothing written"])
    cfg = tmp_path / "given.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free", "model": model}]}))
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    assert cli.main(["verify", "--json", "--config", str(cfg)]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    failing = [r for r in rows if r["status"] == "FAIL" and r["check"].startswith("configs[0]")]
    assert failing and all(n in failing[0]["detail"] for n in needles), failing
    assert failing[0]["fix"]


def test_good_checkpoints_pass_and_the_unread_table_is_said(dirs, tmp_path, capsys, caplog):
    for name in ("ms", "ct"):
        out = tmp_path / f"{name}.yaml"
        with caplog.at_level("WARNING"):
            assert cli.main(["setup", "--fn", "int8_profile_free", "-m", dirs[name], "-o", str(out)]) == 0
        assert os.path.exists(out)
    notes = [r.getMessage() for r in caplog.records if "scheme table" in r.getMessage()]
    if _table_readable():  # an earlier test in this process installed the emulation: the table was read
        assert notes == [], notes
    else:
        assert len(notes) == 1 and "npu_flashrl's schemes only" in notes[0], notes  # the ModelSlim one
    # a bf16 rollout's entry: npu_flashrl stays out of its engine, nothing to check
    bad = _bad_copy(dirs, "w8a16", tmp_path / "bad")
    assert cli.main(["setup", "--fn", "bf16", "-m", bad, "-o", str(tmp_path / "bf16.yaml")]) == 0


def test_profile_refuses_a_modelslim_checkpoint_and_setup_does_not_suggest_it(dirs, tmp_path, capsys):
    """`profile -q` took a static ModelSlim checkpoint, and `setup` then refused the profile and
    suggested the very command that made it."""
    out = tmp_path / "p.pt"
    assert cli.main(["profile", "-m", dirs["bf16"], "-q", dirs["ms"], "-o", str(out), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "ModelSlim checkpoint" in err and "--fn int8_profile_free -m " + dirs["ms"] in err, err
    assert not out.exists()
    # a profile made elsewhere for it: setup names the checkpoint, not `npu-flashrl profile`
    good = tmp_path / "good.pt"
    assert cli.main(["profile", "-m", dirs["bf16"], "-q", dirs["ct"], "-o", str(good), "--no-progress"]) == 0
    capsys.readouterr()
    err = _setup_refuses(dirs["ms"], tmp_path / "c.yaml", capsys, ["ModelSlim checkpoint", "int8_profile_free"],
                         fn="int8")
    assert "npu-flashrl profile" not in err


def test_w4a8_modelslim_is_pointed_at_its_own_fn(dirs, tmp_path, capsys):
    from modelslim_writer import write_modelslim_w4a8

    w4 = str(tmp_path / "w4a8")
    write_modelslim_w4a8(dirs["bf16"], w4, group_size=32)
    assert cli.main(["profile", "-m", dirs["bf16"], "-q", w4, "-o", str(tmp_path / "p.pt"), "--no-progress"]) != 0
    assert "--fn w4a8_profile_free" in capsys.readouterr().err


def test_the_preflight_refuses_the_layer(dirs, tmp_path):
    """`preflight launch` (every recipe's dry run) on an INT8 rollout whose model is a bad ModelSlim
    checkpoint; a bf16 rollout of it is not checked."""
    model = _bad_copy(dirs, "float_int8", tmp_path / "bad")
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free"}]}))
    words = ["python3", "-m", "verl.trainer.main_ppo", f"actor_rollout_ref.model.path={model}"]
    found, _ = P.launch_phase(words, {"FLASHRL_CONFIG": str(cfg)}, [], P.verl_lines.SERVER, True, None, "hint")
    assert any(f"layer {Q_PROJ} is typed FLOAT" in p for p in found), found
    # the entry's own model, named only in the FlashRL config
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free", "model": model}]}))
    words[-1] = f"actor_rollout_ref.model.path={dirs['bf16']}"
    found, _ = P.launch_phase(words, {"FLASHRL_CONFIG": str(cfg)}, [], P.verl_lines.SERVER, True, None, "hint")
    assert any(f"layer {Q_PROJ} is typed FLOAT" in p for p in found), found
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "bf16", "model": model}]}))
    found, _ = P.launch_phase(words, {"FLASHRL_CONFIG": str(cfg)}, [], P.verl_lines.SERVER, True, None, "hint")
    assert not any("typed FLOAT" in p for p in found), found


def test_an_int8_weight_the_description_lacks_is_said(dirs, tmp_path, capsys, caplog, monkeypatch):
    """vllm-ascend raises KeyError for a layer it builds whose weight the description lacks; a layer
    vLLM does not build (DeepSeek's MTP layer) is never looked up, so this is a warning, not a refusal."""
    model = _copy(dirs["ms"], tmp_path / "m")
    path = os.path.join(model, "quant_model_description.json")
    with open(path) as f:
        desc = json.load(f)
    del desc[f"{DOWN}.weight"]
    with open(path, "w") as f:
        json.dump(desc, f)
    with caplog.at_level("WARNING"):
        assert cli.main(["setup", "--fn", "int8_profile_free", "-m", model, "-o", str(tmp_path / "c.yaml")]) == 0
    assert any(f"{DOWN}.weight (int8" in r.getMessage() and "not in the description" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    capsys.readouterr()
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    assert cli.main(["verify", "--json", "--config", str(tmp_path / "c.yaml")]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert any(r["status"] == "warn" and "not in the description" in r["detail"] for r in rows), rows


def _table_readable() -> bool:
    """Whether this process can read the installed vllm-ascend's scheme table (it cannot without
    torch_npu; a test run earlier in the same process may have installed the emulation)."""
    from npu_flashrl import lines
    from npu_flashrl.adapters.vllm_ascend.description_check import reload_keys

    try:
        reload_keys(lines.current())
    except Exception:
        return False
    return True

