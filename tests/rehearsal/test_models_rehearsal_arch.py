"""`npu-flashrl rehearse --arch`: the built-in tiny model's family (qwen2, llama, deepseek_v3). The
full Llama and DeepSeek-V3 rehearsals are run by hand (`npu-flashrl rehearse --arch llama` /
`--arch deepseek_v3`; their results are in the changes' reports); here: what --arch changes and
what it refuses, without starting a rehearsal."""
import argparse

from npu_flashrl.rehearsal.arguments import TINY_ARCHS
from npu_flashrl.rehearsal.model import tiny_settings
from npu_flashrl.sim.synthetic_task import MarkovTask


def _args(arch):
    return argparse.Namespace(arch=arch, train_iters=10, seed=0)


def test_arch_picks_the_tiny_model_and_keeps_the_default_cache_key():
    task = MarkovTask()
    qwen2, llama, _ = (tiny_settings(_args(a), task) for a in TINY_ARCHS)
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
        cli.main(["rehearse", "--arch", "qwen2_5_vl"])
    assert "invalid choice: 'qwen2_5_vl'" in capsys.readouterr().err


def test_deepseek_v3_arch_is_a_moe_run_with_its_routing_config():
    """--arch deepseek_v3: the tiny DeepSeek-V3 (MLA, a dense first layer, MoE with shared experts,
    sigmoid grouped routing); its config drives the MoE checks (the run's model config), so the
    grouped-sigmoid expert check (with shared experts) is the one used."""
    from npu_flashrl.rehearsal.model import is_moe, tiny_model_config
    from npu_flashrl.sim.tiny_models import TINY_DEEPSEEK_V3

    ds = tiny_settings(_args("deepseek_v3"), MarkovTask())
    assert ds["arch"] == "deepseek_v3" and ds["model"] == TINY_DEEPSEEK_V3
    cfg = tiny_model_config(_args("deepseek_v3"))
    assert is_moe(cfg) and cfg["scoring_func"] == "sigmoid" and cfg["n_shared_experts"] == 1
    assert tiny_model_config(_args("llama")) is None and tiny_model_config(_args("qwen2")) is None
    assert MarkovTask().min_vocab_size <= TINY_DEEPSEEK_V3["vocab_size"]


def test_deepseek_v3_arch_refuses_the_profile_mode_before_anything_starts(tmp_path, capsys):
    from npu_flashrl import cli

    code = cli.main(["rehearse", "--arch", "deepseek_v3", "--mode", "profile", "--output-dir",
                     str(tmp_path / "out"), "--no-progress"])
    assert code == 1
    assert "--mode profile with --arch deepseek_v3: a mixture-of-experts model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_grouped_sigmoid_route_equals_transformers_deepseek_v3_routing():
    """The rehearsal's DeepSeek MoE output reference routes as transformers' DeepseekV3MoE
    (`route_tokens_to_experts`: sigmoid, correction bias for the choice, grouped top-k, renorm,
    routed_scaling_factor) on every token whose choice it calls clear, and calls most clear."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from npu_flashrl.rehearsal.state_moe import grouped_sigmoid_route
    from npu_flashrl.sim.tiny_models import tiny_deepseek_v3_config

    cfg = tiny_deepseek_v3_config()
    torch.manual_seed(0)
    moe = DeepseekV3MoE(cfg).float()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
        x = torch.randn(256, cfg.hidden_size)
        want_idx, want_w = moe.route_tokens_to_experts(x @ moe.gate.weight.t())
        w, idx, clear = grouped_sigmoid_route(x, moe.gate.weight, moe.gate.e_score_correction_bias,
                                              cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
                                              cfg.norm_topk_prob, cfg.routed_scaling_factor)
    assert clear.float().mean() > 0.5
    got = {(i, int(e)): float(v) for i in clear.nonzero().flatten().tolist() for e, v in zip(idx[i], w[i])}
    ref = {(i, int(e)): float(v) for i in clear.nonzero().flatten().tolist() for e, v in zip(want_idx[i], want_w[i])}
    assert got.keys() == ref.keys()
    assert all(abs(got[k] - ref[k]) <= 1e-5 * abs(ref[k]) + 1e-7 for k in got)
