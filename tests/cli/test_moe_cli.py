"""FlashRL's int8 profile on a MoE model is refused where a user first meets it: `profile`,
`setup --fn int8` and `verify`, each naming the checkpoint file and an expert tensor and pointing
to fn int8_profile_free (the engine build refuses it too: tests/adapters/vllm_ascend/test_moe_reload.py). The CLI is
called in-process; the tiny Qwen3-MoE checkpoint is built offline; nothing else is stood in."""
import os

import pytest
import yaml

from npu_flashrl import cli, verify
from npu_flashrl.sim.tiny_models import build_tiny_qwen3_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moe") / "bf16")
    build_tiny_qwen3_moe(d, tokenizer=False)
    return d


def test_profile_refuses_a_moe_checkpoint(moe_dir, tmp_path, capsys):
    out = str(tmp_path / "profile.pt")
    assert cli.main(["profile", "-m", moe_dir, "-q", moe_dir, "-o", out, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and ".mlp.experts.0." in err and "int8_profile_free" in err
    assert not os.path.exists(out)


def test_setup_int8_refuses_a_moe_model(moe_dir, tmp_path, capsys):
    cfg = str(tmp_path / "c.yaml")
    code = cli.main(["setup", "-m", moe_dir, "-p", str(tmp_path / "p.pt"), "--fn", "int8", "-o", cfg])
    assert code == 1
    err = capsys.readouterr().err
    assert "MoE expert" in err and "int8_profile_free" in err
    assert not os.path.exists(cfg)
    # the profile-free function takes the same model
    assert cli.main(["setup", "-m", moe_dir, "--fn", "int8_profile_free", "-o", cfg]) == 0
    assert yaml.safe_load(open(cfg))["configs"][0]["fn"] == "int8_profile_free"


def test_verify_fails_an_int8_entry_on_a_moe_model(moe_dir, tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump({"configs": [{"fn": "int8", "model": moe_dir,
                                                 "profile": str(tmp_path / "p.pt"),
                                                 "load_format": "auto"}]}))
    rows = [r for r in verify.config_rows(str(path)) if r["check"].startswith("configs[0]")]
    assert rows[0]["status"] == verify.FAIL
    assert "MoE expert" in rows[0]["detail"] and "int8_profile_free" in rows[0]["fix"]
