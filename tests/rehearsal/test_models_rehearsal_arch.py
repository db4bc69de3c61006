"""`npu-flashrl rehearse --arch`: the built-in tiny model's family (qwen2, llama). The full Llama
rehearsal is run by hand (`npu-flashrl rehearse --arch llama`; its result is in the change's
report); here: what --arch changes and what it refuses, without starting a rehearsal."""
import argparse

from npu_flashrl.rehearsal.arguments import TINY_ARCHS
from npu_flashrl.rehearsal.model import tiny_settings
from npu_flashrl.sim.synthetic_task import MarkovTask


def _args(arch):
    return argparse.Namespace(arch=arch, train_iters=10, seed=0)


def test_arch_picks_the_tiny_model_and_keeps_the_default_cache_key():
    task = MarkovTask()
    qwen2, llama = (tiny_settings(_args(a), task) for a in TINY_ARCHS)
    assert "arch" not in qwen2 and qwen2["model"]["hidden_size"] == 128  # the default's key as before
    assert llama["arch"] == "llama"
    assert llama["model"]["rope_scaling"]["rope_type"] == "llama3"
    assert llama["model"]["attention_bias"] is False and llama["model"]["tie_word_embeddings"] is False


def test_arch_with_model_is_refused_before_anything_starts(tmp_path, capsys):
    from npu_flashrl import cli
    from npu_flashrl.sim.tiny_models import build_tiny_llama

    d = str(tmp_path / "llama")
    build_tiny_llama(d, tokenizer=False)
    code = cli.main(["rehearse", "--arch", "llama", "--model", d, "--output-dir", str(tmp_path / "out"),
                     "--no-progress"])
    assert code == 1
    assert f"--arch llama picks the built-in tiny model; --model {d} brings its own" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unknown_arch_is_refused_by_the_parser(capsys):
    import pytest

    from npu_flashrl import cli

    with pytest.raises(SystemExit):
        cli.main(["rehearse", "--arch", "deepseek_v3"])
    assert "invalid choice: 'deepseek_v3'" in capsys.readouterr().err
