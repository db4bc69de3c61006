"""fn int8 needs a real W8A8 checkpoint loaded for real (a dummy load keeps random scales).

`fn: int8` keeps the W8A8 checkpoint's `weight_scale` through every sync (the profile's scales are
relative to them). So the engine must not be built with `load_format: dummy` (verl's default in sync
mode when the entry leaves it out: random scales no sync replaces), and `setup`/`verify` must refuse
a `-m` that is not a W8A8 checkpoint. Runs vLLM's own `EngineArgs` (and its `create_engine_config`
through our registered patch); the checkpoints are tiny bf16 / compressed-tensors W8A8 pairs.
"""
import json
import os

import pytest
import torch
import yaml

from npu_flashrl import cli, verify
from npu_flashrl import config as C
from npu_flashrl.profile import check_w8a8_checkpoint
from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

pytestmark = pytest.mark.every_line


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return tiny_checkpoint_pair(str(tmp_path_factory.mktemp("pair")))


@pytest.fixture(scope="module")
def profile_pt(pair, tmp_path_factory):
    bf16, w8a8 = pair
    out = str(tmp_path_factory.mktemp("prof") / "profile.pt")
    assert cli.main(["profile", "-m", bf16, "-q", w8a8, "-o", out, "--fn", "int8", "--no-progress"]) == 0
    return out


def test_w8a8_check_reads_headers_and_names_file_and_tensor(pair, tmp_path):
    bf16, w8a8 = pair
    assert check_w8a8_checkpoint(w8a8) == []
    problems = check_w8a8_checkpoint(bf16)
    assert len(problems) == 1
    assert ".safetensors: model.layers.0.self_attn.q_proj.weight is BF16, not int8" in problems[0]
    assert "model.layers.0.self_attn.q_proj.weight_scale is missing" in problems[0]
    # int8 weights whose scale was dropped: the file and the missing tensor are named
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(w8a8):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(w8a8, f))
            t.pop("model.layers.1.mlp.down_proj.weight_scale", None)
            save_file(t, str(broken / f))
        elif f.endswith(".json"):
            data = json.load(open(os.path.join(w8a8, f)))
            data.get("weight_map", {}).pop("model.layers.1.mlp.down_proj.weight_scale", None)
            (broken / f).write_text(json.dumps(data))
    problems = check_w8a8_checkpoint(str(broken))
    assert problems and "model.layers.1.mlp.down_proj.weight_scale is missing" in problems[0]
    assert str(broken) in problems[0] and ".safetensors" in problems[0]


def test_setup_refuses_a_bf16_checkpoint_for_int8_and_writes_nothing(pair, profile_pt, tmp_path, capsys):
    bf16, w8a8 = pair
    out = tmp_path / "c.yaml"
    assert cli.main(["setup", "--fn", "int8", "-m", bf16, "-p", profile_pt, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "q_proj.weight is BF16, not int8" in err and "--fn int8_profile_free" in err
    assert not out.exists()
    # load_format: dummy with fn int8 is refused too
    assert cli.main(["setup", "--fn", "int8", "-m", w8a8, "-p", profile_pt, "-o", str(out),
                     "load_format=dummy"]) == 2
    assert "load_format=dummy" in capsys.readouterr().err and not out.exists()
    # the real W8A8 checkpoint is accepted; setup writes load_format: auto
    assert cli.main(["setup", "--fn", "int8", "-m", w8a8, "-p", profile_pt, "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["configs"][0]["load_format"] == "auto"


def test_verify_refuses_a_non_w8a8_model_and_dummy_load_format(pair, profile_pt, tmp_path):
    bf16, w8a8 = pair

    def rows(entry):
        path = tmp_path / "v.yaml"
        path.write_text(yaml.safe_dump({"configs": [entry]}))
        return [r for r in verify.config_rows(str(path)) if r["check"].startswith("configs[0]")]

    r = rows({"fn": "int8", "model": bf16, "profile": profile_pt, "load_format": "auto"})
    assert r[0]["status"] == verify.FAIL and "not int8" in r[0]["detail"] and "int8_profile_free" in r[0]["fix"]
    r = rows({"fn": "int8", "model": w8a8, "profile": profile_pt, "load_format": "dummy"})
    assert r[0]["status"] == verify.FAIL and "weight_scale" in r[0]["detail"] and r[0]["fix"] == "load_format: auto"
    r = rows({"fn": "int8", "model": w8a8, "profile": profile_pt})
    assert [x["status"] for x in r] == [verify.WARN, verify.OK] and "dummy" in r[0]["detail"]
    r = rows({"fn": "int8", "model": w8a8, "profile": profile_pt, "load_format": "auto"})
    assert [x["status"] for x in r] == [verify.OK]


def _engine_args(model, load_format):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, load_format=load_format, distributed_executor_backend="external_launcher")


@pytest.mark.parametrize("entry_format, engine_format, needle", [
    (None, "dummy", "has no load_format"),     # verl's sync rollout passes dummy
    ("dummy", "auto", "sets load_format: dummy"),
])
def test_engine_build_refuses_int8_with_dummy_weights(pair, profile_pt, entry_format, engine_format,
                                                      needle, monkeypatch):
    from npu_flashrl.adapters import vllm_engine

    _, w8a8 = pair
    monkeypatch.setenv("FLASHRL_CONFIG", "/runs/flashrl.yaml")
    entry = {"fn": "int8", "model": w8a8, "profile": profile_pt}
    if entry_format:
        entry["load_format"] = entry_format
    cfg = C.FlashRLConfig(entries=[C.RolloutConfig.from_dict(entry)])
    args = _engine_args(pair[0], engine_format)  # verl passes the trainer's bf16 model
    with pytest.raises(C.ConfigError, match=r"load_format=dummy") as info:
        vllm_engine.apply_entry(args, cfg)
    msg = str(info.value)
    assert needle in msg and "load_format: auto" in msg and "/runs/flashrl.yaml" in msg
    assert getattr(args, "quantization", None) != "ascend"  # refused before anything was configured


def test_engine_build_accepts_int8_loaded_from_the_checkpoint(pair, profile_pt, monkeypatch):
    from npu_flashrl import patches
    from npu_flashrl.adapters import vllm_engine

    _, w8a8 = pair
    monkeypatch.setenv("FLASHRL_CONFIG", "/runs/flashrl.yaml")
    cfg = C.FlashRLConfig(entries=[C.RolloutConfig.from_dict(
        {"fn": "int8", "model": w8a8, "profile": profile_pt, "load_format": "auto"})])
    args = _engine_args(pair[0], "dummy")
    try:
        entry = vllm_engine.apply_entry(args, cfg)
        assert entry.fn == "int8" and args.load_format == "auto" and args.quantization == "ascend"
        assert args.model == w8a8
        # through vLLM's own create_engine_config (our patch runs apply_entry before vLLM's body)
        assert patches.apply_patch(vllm_engine.PATCH_NAME)
        vllm_engine.set_config(C.FlashRLConfig(entries=[C.RolloutConfig.from_dict(
            {"fn": "int8", "model": w8a8, "profile": profile_pt})]))
        with pytest.raises(C.ConfigError, match="has no load_format"):
            _engine_args(w8a8, "dummy").create_engine_config()
    finally:
        vllm_engine.set_config(None)


def test_why_dummy_is_refused_a_synced_int8_model_keeps_random_scales(va, pair, profile_pt):
    """The defect the refusal prevents, on the real CPU vLLM W8A8_DYNAMIC model (tests/conftest.py
    `va`): built with load_format=dummy, a complete fn-int8 sync leaves vLLM's random weight_scale in
    use (the profile keeps the checkpoint's scales), while a model loaded from the checkpoint has them."""
    from npu_flashrl.sim import cpu_vllm
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    bf16, w8a8 = pair
    hf = build_tiny_qwen2(os.path.join(os.path.dirname(bf16), "trainer"), seed=5)
    weights = [(n, p.detach().float().clone()) for n, p in hf.named_parameters()]
    scales = {}
    for fmt in ("auto", "dummy"):
        with cpu_vllm.CpuVllm(w8a8, quantization="ascend", load_format=fmt,
                              choice=cpu_vllm.int8("int8", profile_pt)) as v:
            v.model.load_weights(weights)
            va.end_weight_sync(v.model)
            scales[fmt] = {n: p.detach().clone() for n, p in v.model.named_parameters()
                           if n.endswith("weight_scale")}
    from safetensors import safe_open

    ckpt = {}
    for f in os.listdir(w8a8):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(w8a8, f), framework="pt") as fh:
                ckpt.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith("weight_scale")})
    q = torch.cat([ckpt[f"model.layers.0.self_attn.{p}.weight_scale"] for p in ("q_proj", "k_proj", "v_proj")])
    name = "model.layers.0.self_attn.qkv_proj.weight_scale"
    torch.testing.assert_close(scales["auto"][name].flatten().float(), q.flatten().float())
    assert not torch.allclose(scales["dummy"][name].flatten().float(), q.flatten().float())
