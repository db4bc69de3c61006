"""ModelSlim's mixed W4A8 MoE checkpoints under `fn: w4a8_profile_free`: the layout ModelSlim's
W4A8 MoE recipes write (msit lab_practice/deepseek_v3/deepseek_w4a8_per_channel.yaml:
`*self_attn*` and the dense `*mlp*` W8A8_DYNAMIC, `*mlp.experts*` W4A8_DYNAMIC), on the tiny
Qwen3-MoE: attention projections W8A8_DYNAMIC, routed experts W4A8_DYNAMIC, per-group (256) or
per-channel (`group_size` 0). The policy is cold-loaded from that checkpoint, each layer takes
the trainer's bf16 weights at every sync through the scheme its description gives it (the
W8A8_DYNAMIC layers by the per-channel INT8 rule, the W4A8 experts by the staged int4 one), and
after every sync equals a fresh load of the same weights bit for bit, data pointers unchanged.
What stays unsupported is refused by name: a static W8A8 layer in such a checkpoint (at engine
build and in the `setup` / `verify` check), and the mixed layout from a bare bf16 checkpoint
(not expressible: its in-memory description types every projection W4A8_DYNAMIC).

Real code: vLLM's Qwen3MoeForCausalLM and loaders, vllm-ascend's AscendModelSlimConfig,
`AscendW8A8DynamicLinearMethod` and `AscendW4A8DynamicFusedMoEMethod` (create_weights,
post-processing, apply), vLLM's `process_weights_after_loading` as verl 0.9 runs it after every
sync. Stand-ins (named): torch_npu (the emulation: `kernels.emulation`, `kernels.int4_moe`,
`kernels.moe_reference`), the mc2 group's HCCL name (`cpu_vllm._mc2_without_hccl`), vLLM's CPU
platform accepting "ascend", plain causal attention, verl's IPC sender (`sim.sync.BucketBuffer`);
the checkpoints are written by the tests' ModelSlim-format writer (`modelslim_writer`) with
npu_flashrl's quantizers (ModelSlim's own is compiled). The forward is run for the per-group
form only (the per-channel A8W4 call is not emulated: docs/w4a8.md, Fused MoE).
"""
import json
import os
import shutil

import pytest
import torch

from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import BucketBuffer, bucket_bytes, post_sync, ptrs, random_buckets, state
from npu_flashrl.sim.tiny_models import trainer_weights

from helpers import assert_equal_states, fresh_w4a8_state
from w4a8_moe_models import GROUP, HIDDEN, MOE_I, build_pair, require_w4a8_moe_reload

pytestmark = pytest.mark.every_line
W4A8_FN = "w4a8_profile_free"


@pytest.fixture(scope="module", params=[GROUP, 0], ids=["per_group", "per_channel"])
def ckpts(request, va, tmp_path_factory):
    """{seed: (bf16 dir, mixed ModelSlim dir, HF bf16 model, fresh load's state)} and the group
    size."""
    from transformers import AutoModelForCausalLM

    require_w4a8_moe_reload()
    root = str(tmp_path_factory.mktemp(f"w4a8_mixed_{request.param}"))
    out = {}
    for seed in (0, 1):
        bf16, ms = build_pair(root, seed, group_size=request.param, mixed=True)
        out[seed] = (bf16, ms, AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16),
                     fresh_w4a8_state(ms))
    return out, request.param


def policy(model_dir, group_size=None):
    from npu_flashrl.adapters.engine_choice import EngineChoice

    return cpu_vllm.CpuVllm(model_dir, quantization="ascend",
                            choice=EngineChoice(fn=W4A8_FN, group_size=group_size))


def _sync(va, v, hf, step):
    expert_bytes = 3 * HIDDEN * MOE_I * 2  # gate + up + down of one expert, bf16
    buckets = random_buckets(trainer_weights(hf), seed=step, max_bytes=4 * expert_bytes)
    buffer = BucketBuffer(bucket_bytes(buckets))
    for bucket in buckets:
        buffer.deliver(v.model, bucket)
    assert va.end_weight_sync(v.model) == []
    post_sync(v)  # verl 0.9 runs post-processing after every sync: a no-op here


def test_the_checkpoint_is_modelslims_mixed_layout(ckpts):
    """The writer types the attention projections W8A8_DYNAMIC and the experts W4A8_DYNAMIC (so
    the tests below exercise both types in one model)."""
    (_, ms, _, _), group = ckpts[0][0], ckpts[1]
    with open(os.path.join(ms, "quant_model_description.json")) as f:
        desc = json.load(f)
    assert desc["group_size"] == group
    assert desc["model.layers.0.self_attn.q_proj.weight"] == "W8A8_DYNAMIC"
    assert desc["model.layers.1.self_attn.o_proj.weight_scale"] == "W8A8_DYNAMIC"
    assert desc["model.layers.0.mlp.experts.3.down_proj.weight"] == "W4A8_DYNAMIC"
    assert desc["model.layers.0.mlp.gate.weight"] == "FLOAT"


def test_every_sync_equals_a_fresh_mixed_load_in_place(va, ckpts):
    (by_seed, group) = ckpts
    (_, ms0, hf0, want0), (_, _, hf1, want1) = by_seed[0], by_seed[1]
    want = {0: want0, 1: want1}
    with policy(ms0) as v:
        m = v.model
        loader = m._npu_flashrl_loader
        assert {t.scheme.key for t in loader.experts.values()} == {("W4A8_DYNAMIC", "moe")}
        assert {t.scheme.key for t in loader.targets.values()} == {("W8A8_DYNAMIC", "linear")}
        assert {int(t.layer.quant_method.quant_method.group_size) for t in loader.experts.values()} == {group}
        attn = m.model.layers[0].self_attn.qkv_proj
        assert type(attn.quant_method.quant_method).__name__ == "AscendW8A8DynamicLinearMethod"
        assert attn.weight.dtype == torch.int8
        assert_equal_states(state(m), want[0])  # the cold load is vllm-ascend's own
        before = ptrs(m)
        for step, (seed, hf) in enumerate(((1, hf1), (0, hf0), (1, hf1))):
            _sync(va, v, hf, step)
            assert_equal_states(state(m), want[seed])
            assert ptrs(m) == before, "a sync must write every layer in place"
            assert loader.staging_bytes() == 0


def test_the_mixed_model_runs_its_forward_after_a_sync(va, ckpts):
    """Per-group only (where the W4A8 MoE forward runs on the CPU): after a sync to seed 1 the
    logits are a fresh load's of seed 1, and differ from seed 0's (the sync changed both the
    INT8 attention and the int4 experts the forward reads)."""
    from npu_flashrl.sim import ascend_harness

    by_seed, group = ckpts
    if group == 0:
        pytest.skip("the per-channel A8W4 call is not emulated (docs/w4a8.md, Fused MoE)")
    unsupported = ascend_harness.cpu_moe_forward_unsupported()
    if unsupported:
        pytest.skip(unsupported)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    with cpu_vllm.CpuVllm(by_seed[1][1], quantization="ascend") as fresh:
        want = fresh.logits(ids)
    with policy(by_seed[0][1]) as v:
        before = v.logits(ids)
        _sync(va, v, by_seed[1][2], step=0)
        got = v.logits(ids)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert not torch.equal(before, want)


def test_a_nan_attention_weight_is_refused_by_name_and_nothing_is_written(va, ckpts):
    from npu_flashrl.quant import WeightSyncError

    by_seed, _ = ckpts
    (_, ms0, _, want0), (_, _, hf1, _) = by_seed[0], by_seed[1]
    with policy(ms0) as v:
        bad = [(n, t.clone()) for n, t in trainer_weights(hf1)]
        name = "model.layers.1.self_attn.k_proj.weight"
        i = next(k for k, (n, _) in enumerate(bad) if n == name)
        bad[i][1][0, 1] = float("nan")
        with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
            v.model.load_weights(bad)
        with pytest.raises(WeightSyncError, match="weight sync failed"):
            va.end_weight_sync(v.model)
        assert_equal_states(state(v.model), want0)


def _retyped(ms, tmp_path, module, quant_type, extra=None):
    """A copy of checkpoint `ms` whose description types `module`'s tensors `quant_type`."""
    out = str(tmp_path / f"retyped_{quant_type}")
    shutil.copytree(ms, out)
    path = os.path.join(out, "quant_model_description.json")
    with open(path) as f:
        desc = json.load(f)
    for k in [k for k in desc if k.startswith(module + ".")]:
        desc[k] = quant_type
    desc.update(extra or {})
    with open(path, "w") as f:
        json.dump(desc, f)
    return out


def test_a_static_w8a8_layer_is_refused_at_engine_build_naming_it(va, ckpts, tmp_path):
    """ModelSlim's W4A8 recipes with static W8A8 attention (e.g. deepseekv3_w4a8c8_per_channel)
    stay unsupported: the engine build names the layer and its type."""
    from npu_flashrl.quant import WeightSyncError

    ms = ckpts[0][0][1]
    static = _retyped(ms, tmp_path, "model.layers.0.self_attn.o_proj", "W8A8")
    with pytest.raises(WeightSyncError, match=r"model\.layers\.0\.self_attn\.o_proj: a vllm-ascend W8A8 "
                                              r"layer, and fn 'w4a8_profile_free' quantizes for "
                                              r"W4A8_DYNAMIC/W8A8_DYNAMIC layers only"):
        with policy(static):
            pass


def test_the_int8_fn_still_refuses_the_w4a8_experts(va, ckpts):
    from npu_flashrl.adapters.engine_choice import EngineChoice
    from npu_flashrl.quant import WeightSyncError

    with pytest.raises(WeightSyncError, match=r"mlp\.experts: a vllm-ascend W4A8_DYNAMIC layer, and fn "
                                              r"'int8_profile_free'"):
        with cpu_vllm.CpuVllm(ckpts[0][0][1], quantization="ascend",
                              choice=EngineChoice(fn="int8_profile_free")):
            pass


def test_a_checkpoint_without_w4a8_layers_is_refused_at_engine_build(va, ckpts, tmp_path):
    """The W4A8 fn serves W8A8_DYNAMIC layers only beside W4A8 ones: a ModelSlim checkpoint of
    W8A8_DYNAMIC layers alone (attention and experts) would otherwise run an INT8 rollout under
    a W4A8 entry, silently."""
    from modelslim_writer import write_modelslim_w4a8

    from npu_flashrl.quant import WeightSyncError

    (by_seed, group) = ckpts
    if group == 0:
        pytest.skip("one checkpoint suffices (the group size plays no part)")
    only8 = str(tmp_path / "w8a8_dynamic_only")
    write_modelslim_w4a8(by_seed[0][0], only8, group_size=group, quantize=lambda name: False,
                         w8a8_dynamic=lambda name: True)
    with pytest.raises(WeightSyncError, match=r"a vllm-ascend W8A8_DYNAMIC layer, and no layer of the model "
                                              r"is W4A8_DYNAMIC: fn 'w4a8_profile_free' serves W8A8_DYNAMIC "
                                              r"layers only beside its own"):
        with policy(only8):
            pass


def test_setup_checks_accept_the_mixed_checkpoint_and_name_what_is_not(ckpts, tmp_path):
    """`setup` / `verify`'s checkpoint check (headers only): the mixed checkpoint passes; a static
    W8A8 projection and a W8A8_DYNAMIC projection without its scale are named."""
    from npu_flashrl.w4a8_checkpoint import w4a8_checkpoint_problems

    (by_seed, group) = ckpts
    ms = by_seed[0][1]
    assert w4a8_checkpoint_problems(ms) == []
    assert w4a8_checkpoint_problems(ms, group_size=group) == []
    (p,) = w4a8_checkpoint_problems(_retyped(ms, tmp_path, "model.layers.0.self_attn.o_proj", "W8A8"))
    assert "model.layers.0.self_attn.o_proj is typed W8A8 (1 such projection(s))" in p
    assert "W4A8_DYNAMIC and W8A8_DYNAMIC" in p
    broken = str(tmp_path / "no_scale")
    shutil.copytree(ms, broken)
    from safetensors.torch import load_file, save_file

    f = os.path.join(broken, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.q_proj.weight_scale"]
    save_file(tensors, f)
    (p,) = w4a8_checkpoint_problems(broken)
    assert p.startswith("model.layers.1.self_attn.q_proj: typed W8A8_DYNAMIC")
    assert "model.layers.1.self_attn.q_proj.weight_scale" in p


def test_the_entrys_group_size_is_not_asked_of_the_w8a8_dynamic_layers():
    """The entry's `group_size` is checked against the W4A8 layers only: a mixed model whose
    W8A8_DYNAMIC projection's input dim it does not divide is accepted (that layer has no
    groups), a W4A8 one is named. Stand-ins: the targets map and its layers as plain namespaces
    (what `check_quantizer` reads of them), no engine."""
    from types import SimpleNamespace as NS

    from npu_flashrl.adapters.vllm_ascend.targets import check_quantizer
    from npu_flashrl.quant import WeightSyncError
    from npu_flashrl.quant.registry import make_quantizer

    def layer(path, quant_type, shape):
        scheme = NS(quant_type=quant_type, check_target=lambda target, quantizer: None)
        return NS(path=path, scheme=scheme, full_shape=lambda name: shape)

    def targets(*layers):
        linear = {f"{t.path}.weight": t for t in layers}
        return NS(moe=dict, layers={t.path: t for t in layers}, linear=lambda: linear)

    q = make_quantizer(W4A8_FN, torch.bfloat16, group_size=256)
    attn = layer("model.layers.0.self_attn.o_proj", "W8A8_DYNAMIC", (256, 320))
    fits = layer("model.layers.0.mlp.up_proj", "W4A8_DYNAMIC", (320, 256))
    check_quantizer(q, targets(attn, fits), {}, torch.nn.Module())
    w4 = layer("model.layers.0.mlp.down_proj", "W4A8_DYNAMIC", (256, 320))
    with pytest.raises(WeightSyncError, match=r"model\.layers\.0\.mlp\.down_proj: input dim 320 is not "
                                              r"a multiple of group_size 256"):
        check_quantizer(q, targets(attn, fits, w4), {}, torch.nn.Module())
