"""Trainer side: simulated optimizer steps on the fp32 masters, and the trainer's log-probs."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, List, Tuple

from npu_flashrl.rehearsal.common import progress_bar


def hf_load(model_dir: str, dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def target_logp(logits, ids):
    """Teacher-forced log-probs [B, T-1] of ids[:, 1:] from logits [B, T, V] (fp32)."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None].to(logp.device)).squeeze(-1).cpu()


def simulate_training(master, task, steps: int, inner: int, lr: float, seed: int, device: str,
                      progress: bool) -> Tuple[List[List[Tuple[str, Any]]], List[float], List[float]]:
    """K optimizer-like changes: `inner` AdamW iterations per step on the fp32 master weights.

    Returns the bf16 weights after each step (HF names; what an FSDP trainer with param_dtype bf16
    holds and syncs), the training loss per step and the relative weight change per step
    (||W_k - W_k-1|| / ||W_k-1|| over all parameters)."""
    import torch

    from npu_flashrl.sim import synthetic_task

    opt = torch.optim.AdamW(master.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    data = task.batches(16, 32, seed + 1)
    snapshots, losses = [], []
    update_rel: List[float] = []
    prev = [p.detach().clone() for p in master.parameters()]
    master.train()
    with progress_bar(steps, "simulated training steps", progress) as bar:
        for _ in range(steps):
            step_loss = 0.0
            for _ in range(inner):
                loss = synthetic_task.lm_loss(master, next(data).to(device))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step_loss += float(loss.detach()) / inner
            losses.append(step_loss)
            with torch.no_grad():
                num = sum(float((p.detach() - q).float().norm() ** 2) for p, q in zip(master.parameters(), prev))
                den = sum(float(q.float().norm() ** 2) for q in prev)
                update_rel.append(math.sqrt(num / den) if den > 0 else float("nan"))
                prev = [p.detach().clone() for p in master.parameters()]
            snapshots.append([(n, p.detach().to(torch.bfloat16).clone()) for n, p in master.named_parameters()]
                             + persistent_buffers(master))
            bar.update(1)
    master.eval()
    return snapshots, losses, update_rel


def persistent_buffers(model):
    """(name, tensor) of the model's persistent buffers, in their own dtype: what the trainer's
    `state_dict()` sends beside the parameters (DeepSeek-V3's router `e_score_correction_bias`,
    fp32; rotary tables are not persistent)."""
    keys = set(model.state_dict().keys())
    return [(n, b.detach().clone()) for n, b in model.named_buffers() if n in keys]


@contextlib.contextmanager
def _no_grad():
    import torch

    with torch.no_grad():
        yield


def trainer_logps(trainer, snapshots, eval_ids, fp32_head: bool, progress: bool) -> List[Dict[str, Any]]:
    """Per step: trainer log-probs with the bf16 weights (bf16 lm head, and fp32 lm head if asked)."""
    from npu_flashrl.adapters import transformers as hf_fp32

    params = dict(trainer.named_parameters())
    params.update(trainer.named_buffers())  # persistent buffers travel too (see persistent_buffers)
    out = []
    with progress_bar(len(snapshots), "trainer log-probs (transformers bf16)", progress) as bar, _no_grad():
        for snap in snapshots:
            for name, t in snap:
                params[name].data.copy_(t.to(params[name].device))
            ids = eval_ids.to(next(trainer.parameters()).device)
            row = {"bf16": target_logp(trainer(input_ids=ids).logits, eval_ids)}
            if fp32_head:
                hf_fp32.enable_fp32_lm_head(trainer)
                try:
                    row["fp32head"] = target_logp(trainer(input_ids=ids).logits, eval_ids)
                finally:
                    hf_fp32.disable_fp32_lm_head(trainer)
            out.append(row)
            bar.update(1)
    return out
