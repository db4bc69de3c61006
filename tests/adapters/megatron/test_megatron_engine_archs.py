"""verl 0.9.1's Megatron engine -> verl's bucketed sync -> npu_flashrl's INT8 rollout for the other
architectures: a tiny Llama 3.x (untied, GQA, llama3 rope scaling) through mbridge's LlamaBridge
at TP=2; and what stops DeepSeek-V3 (mbridge's DeepseekV3Bridge) on this stack.

The rig is test_megatron_engine.py's (tests/support/megatron_engine_rig.py: two rank processes running verl's own
`MegatronEngineWithLMHead`, `npu_flashrl.sim.megatron_engine`; rank 0 streams
`get_per_tensor_param` with verl's `BucketedWeightSender` into verl's `update_weights_from_ipc` on
a vLLM model built on vllm-ascend's W8A8_DYNAMIC layers through npu_flashrl). Stand-ins: the
engine's (`npu_flashrl/sim/megatron_engine.py`: CPU verl platform, CPU RNG tracker,
`torch.cuda.current_device`/`Module.cuda`, megatron-core's local layer spec instead of
TransformerEngine, peft/datasets stubs, the engine built `forward_only`, mbridge instead of
Megatron-Bridge) and the receiver's (tests/support/verl_server_rig.py).
"""
import json
import os

import pytest

from npu_flashrl import lines

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.9 (verl/workers/engine/megatron), e.g. 0.9.1"),
]

from helpers import forward_tensors  # noqa: E402
from megatron_engine_rig import (BUCKET_BYTES, EngineRanks, engine_rig,  # noqa: E402
                                 three_syncs_equal_fresh_loads)
from verl_server_rig import SHAPE, build_rollout, need_int8, rollout_worker  # noqa: E402
from verl_server_rig import int8_ready  # noqa: E402,F401  (a fixture)


@pytest.fixture(scope="module")
def llama_rig(int8_ready):
    from npu_flashrl.sim.tiny_models import build_tiny_llama

    # untied (the 8B / 70B layout): mbridge exports lm_head.weight as its own tensor
    with engine_rig(int8_ready, "npu_flashrl_megatron_llama_", "llama",
                    lambda d, seed: build_tiny_llama(d, seed=seed, tokenizer=seed == 0,
                                                     config_overrides=dict(SHAPE, tie_word_embeddings=False))
                    ) as rig:
        yield rig


def test_llama_engine_exports_hf_names_full_shapes(llama_rig):
    """mbridge's LlamaBridge at TP=2: every HF parameter of the Llama checkpoint once, at full
    shape, bf16 (GQA's k/v at their own width), the same on both ranks."""
    ranks, model = llama_rig["ranks"], llama_rig["hf"][0]
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    ranks.tell(names=True)
    per_rank = [json.loads(s) for s in ranks.expect("names")]
    want = {n: list(p.shape) for n, p in model.named_parameters()}
    assert "lm_head.weight" in want
    for exported in per_rank:
        names = [n for n, _, _ in exported]
        assert len(names) == len(set(names))
        assert {n: s for n, s, _ in exported} == want
        assert {d for _, _, d in exported} == {"torch.bfloat16"}
    assert per_rank[0] == per_rank[1]


def test_llama_three_syncs_equal_fresh_int8_load(llama_rig):
    """Three syncs from the TP=2 Megatron engine into vLLM's Llama on vllm-ascend's
    W8A8_DYNAMIC layers through npu_flashrl: each equals a fresh INT8 load of that checkpoint,
    every tensor at its old address, q/k/v and gate/up split across 1 MB buckets."""
    need_int8(llama_rig["int8_ready"])
    fn, rig, ranks = "int8_profile_free", llama_rig, llama_rig["ranks"]
    with build_rollout(rig, 0, fn) as v:
        worker, buckets = rollout_worker(v)
        assert getattr(v.model, "_npu_flashrl_loader", None) is not None
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        three_syncs_equal_fresh_loads(rig, ranks, worker, buckets, v.model, fn, ptrs, BUCKET_BYTES, "llama")


def test_deepseek_v3_engine_stops_at_mbridges_rope_theta(llama_rig):
    """What blocks DeepSeek-V3's Megatron export on this stack (the architectures table's
    "Megatron export" cell): verl 0.9.1's `_build_tf_config` calls mbridge's
    `AutoBridge.from_config` before `make_megatron_module` copies `rope_parameters['rope_theta']`
    to `hf_config.rope_theta`; mbridge 0.15.1's DeepseekV3Bridge reads `hf_config.rope_theta` in
    its constructor and transformers 5's DeepseekV3Config has none (Llama's / Qwen2's bridges
    read it later, after verl set it). When this test fails, the cell is out of date."""
    from npu_flashrl import architectures
    from npu_flashrl.sim.tiny_models import build_tiny_deepseek_v3

    d = os.path.join(llama_rig["root"], "deepseek_v3")
    build_tiny_deepseek_v3(d, seed=0, tokenizer=True)
    with pytest.raises(AssertionError) as e:
        EngineRanks(d, world=1, tp=1, handle=llama_rig["handle"]).close()
    msg = str(e.value)
    assert "mbridge/models/deepseek_v3.py" in msg and "_build_config" in msg
    assert "AttributeError: 'DeepseekV3Config' object has no attribute 'rope_theta'" in msg
    assert architectures.covered("DeepseekV3ForCausalLM").cell("megatron_export") == architectures.DEEPSEEK_MEGATRON
