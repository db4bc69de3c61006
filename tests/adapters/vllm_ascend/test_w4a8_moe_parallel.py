"""W4A8 MoE rollouts on two ranks: with expert parallelism (EP=2, per-group: each rank holds half
of the experts, whole, by vLLM's expert map) and tensor parallelism (TP=2, per-channel: every
rank holds every expert, half of its intermediate channels), a sync of the trainer's full bf16
experts leaves each rank equal bit for bit to a fresh load of the same weights on that rank
(same parallel config), every data pointer unchanged. The experts are the W4A8 layers (the
attention stays FLOAT: its o_proj has 128 input channels per rank, below the group size 256). TP=2 runs per-channel because the tiny
model's per-rank moe_intermediate (128) is below the per-group size the A8W4 op takes (256):
per-group TP=2 needs moe_intermediate >= 512 here, a larger model than this harness runs quickly.

Real code: vLLM's Qwen3MoeForCausalLM, FusedMoE `weight_loader` and expert map, its TP / EP
groups over gloo, vllm-ascend's AscendModelSlimConfig and `AscendW4A8DynamicFusedMoEMethod`
(create_weights with `tp_size` 1 under EP, post-processing). Stand-ins (named): torch_npu (the
emulation), the mc2 group's HCCL name (`cpu_vllm._mc2_without_hccl`), gloo for HCCL (two
spawned CPU processes, torch.multiprocessing), vLLM's CPU platform accepting "ascend", plain
causal attention; the ModelSlim checkpoints are written by the tests' ModelSlim-format writer.
No forward is run (the W4A8 MoE forward on two ranks would need the MC2 / all-to-all
dispatchers, which need HCCL).
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm

from w4a8_moe_models import EXPERTS, GROUP, build_pair, require_w4a8_moe_reload

pytestmark = pytest.mark.every_line
W4A8_FN = "w4a8_profile_free"


def _config(model_dir, expert_parallel, choice=None):
    from npu_flashrl.adapters.engine_choice import with_choice

    extra = with_choice({}, choice) if choice is not None else None
    cfg = cpu_vllm.make_vllm_config(model_dir, quantization="ascend", tp_size=2, additional_config=extra)
    cfg.parallel_config.enable_expert_parallel = expert_parallel
    return cfg


def _worker(rank, port, ms0, ms1, bf16_1, out_dir, expert_parallel):
    va = cpu_vllm.prepare_int8_worker()
    from transformers import AutoModelForCausalLM

    from npu_flashrl.adapters.engine_choice import EngineChoice
    from npu_flashrl.sim.sync import ptrs, state
    from npu_flashrl.sim.tiny_models import trainer_weights

    init = f"tcp://127.0.0.1:{port}"
    with cpu_vllm.CpuVllm(ms1, quantization="ascend", tp_size=2, rank=rank, init_method=init,
                          vllm_config=_config(ms1, expert_parallel)) as v:
        want = state(v.model)  # a fresh load of the synced weights on this rank
    choice = EngineChoice(fn=W4A8_FN)
    with cpu_vllm.CpuVllm(ms0, quantization="ascend", tp_size=2, rank=rank, init_method=init,
                          vllm_config=_config(ms0, expert_parallel, choice), choice=choice) as v:
        m = v.model
        layer = m.model.layers[0].mlp.experts
        local = [e for e in range(EXPERTS) if layer._map_global_expert_id_to_local_expert_id(e) != -1]
        keys = {t.scheme.key for t in m._npu_flashrl_loader.experts.values()}
        before = ptrs(m)
        m.load_weights(trainer_weights(AutoModelForCausalLM.from_pretrained(bf16_1, dtype=torch.bfloat16)))
        problems = va.end_weight_sync(m)
        got = state(m)
        differ = sorted(n for n in want if n not in got or got[n].dtype != want[n].dtype
                        or not torch.equal(got[n], want[n]))
        torch.save({"local": local, "keys": keys, "problems": problems, "differ": differ,
                    "missing": sorted(set(got) ^ set(want)), "in_place": ptrs(m) == before},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("expert_parallel, group_size", [(True, GROUP), (False, 0)],
                         ids=["ep2-per-group", "tp2-per-channel"])
def test_each_rank_equals_a_fresh_load_after_a_sync(va, tmp_path, expert_parallel, group_size):
    import torch.multiprocessing as mp

    require_w4a8_moe_reload()  # the process is prepared already (va)
    root = str(tmp_path / "ckpts")
    # the experts only: the attention's o_proj has 128 input channels per rank at TP 2, which
    # the W4A8 linear layers' group size 256 does not divide
    (_, ms0), (bf16_1, ms1) = (build_pair(root, s, group_size, experts_only=True) for s in (0, 1))
    out = str(tmp_path / "out")
    os.makedirs(out)
    mp.start_processes(_worker, args=(cpu_vllm.free_port(), ms0, ms1, bf16_1, out, expert_parallel),
                       nprocs=2, start_method="spawn")
    seen = set()
    for rank in range(2):
        r = torch.load(os.path.join(out, f"rank{rank}.pt"))
        assert r["keys"] == {("W4A8_DYNAMIC", "moe")}
        assert r["problems"] == [] and r["missing"] == [], (rank, r["problems"], r["missing"])
        assert r["differ"] == [], f"rank {rank}: {r['differ'][:4]} differ from a fresh load"
        assert r["in_place"], f"rank {rank}: a sync must write in place"
        if expert_parallel:
            assert len(r["local"]) == EXPERTS // 2
        else:
            assert r["local"] == list(range(EXPERTS))
        seen |= set(r["local"])
    assert seen == set(range(EXPERTS))
