"""The rehearsal's MLA check (`rehearsal/state_mla.py`) on a tiny DeepSeek-V3 built as vllm-ascend
builds it (INT8 rollout, `sim.mla_harness`): right after a load it passes against the pushed
weights; a stale W_UK_T, a re-allocated W_UV and a kv_b_proj that differs from the pushed one are
each named.

Stand-ins: the CPU harness's (emulated torch_npu; `AscendMLAImpl.forward` in plain torch, not
called here)."""
import torch

from npu_flashrl.sim.tiny_models import build_tiny_deepseek_v3, trainer_weights


def test_mla_check_passes_a_fresh_load_and_names_stale_moved_and_wrong(va, tmp_path):
    from npu_flashrl.rehearsal.state_mla import MlaAbsorbedCheck
    from npu_flashrl.sim import mla_harness

    from helpers import build

    mla_harness.enable_ascend_mla()
    hf = build_tiny_deepseek_v3(str(tmp_path / "m"), seed=3, tokenizer=False)
    other = dict(trainer_weights(build_tiny_deepseek_v3(str(tmp_path / "o"), seed=4, tokenizer=False)))
    pushed = dict(trainer_weights(hf))
    with build(va, str(tmp_path / "m")) as v:
        check = MlaAbsorbedCheck(v.model)
        assert check and check.check(pushed, 1) == {"step": 1, "layers": 3, "problems": []}
        impl1 = v.model.model.layers[1].self_attn.mla_attn.mla_attn.impl
        impl1.W_UK_T.add_(1)  # stale in place
        impl2 = v.model.model.layers[2].self_attn.mla_attn.mla_attn.impl
        impl2.W_UV = impl2.W_UV.clone()  # re-allocated
        wrong = dict(pushed, **{"model.layers.0.self_attn.kv_b_proj.weight":
                                other["model.layers.0.self_attn.kv_b_proj.weight"]})
        problems = check.check(wrong, 2)["problems"]
    assert "model.layers.0.self_attn.kv_b_proj.weight differs from the pushed tensor" in problems
    assert "model.layers.1.self_attn W_UK_T is not derived from the pushed kv_b_proj (stale)" in problems
    assert "model.layers.2.self_attn W_UV moved since the cold load" in problems
    assert len(problems) == 5  # layer 0: kv_b_proj and both derivations against the wrong tensor
