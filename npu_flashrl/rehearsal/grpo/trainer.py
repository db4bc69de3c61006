"""The GRPO trainer: fp32 master weights (transformers Qwen2), bf16 compute, AdamW, one update per
mini-batch, and the bf16 weights it syncs.

Like verl's FSDP actor with `param_dtype=bf16` (the trainer side of the rehearsal): the forward
passes (old log-probs and the policy loss) run under bf16 autocast from the fp32 masters; the
gradients land on the fp32 masters, clipped to norm 1.0 (verl's `actor.grad_clip`), and AdamW
steps them. What is synced after a step is the masters cast to bf16. With `fp32_head` the lm head
computes its logits in fp32 (`adapters.transformers.enable_fp32_lm_head`, FLASHRL_LMHEAD_FP32 on the
trainer side).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

import torch


class GrpoTrainer:
    def __init__(self, master_dir: str, device: str, lr: float):
        from npu_flashrl.rehearsal.trainer import hf_load

        self.device, self.lr = device, lr
        self.model = hf_load(master_dir, torch.float32, device)
        self._initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.opt = None

    def reset(self, lr_scale: float = 1.0) -> None:
        """Back to the pre-trained weights with a fresh optimizer (a new seed's run) at `lr_scale` x lr."""
        self.model.load_state_dict(self._initial)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr * lr_scale, betas=(0.9, 0.999),
                                     weight_decay=0.0)

    @contextlib.contextmanager
    def _head(self, fp32_head: bool):
        if not fp32_head:
            yield
            return
        from npu_flashrl.adapters import transformers as hf_fp32

        hf_fp32.enable_fp32_lm_head(self.model)
        try:
            yield
        finally:
            hf_fp32.disable_fp32_lm_head(self.model)

    def logp(self, ids: torch.Tensor, prompt_len: int, fp32_head: bool, grad: bool,
             autocast: bool = True) -> torch.Tensor:
        """Log-probs [B, L] of the response tokens ids[:, prompt_len:] (fp32 log-softmax of the logits);
        `autocast=False`: the fp32 masters in fp32 throughout (a negative control's stand-in rollout)."""
        ids = ids.to(self.device)
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        cast = (torch.autocast(device_type=self.device, dtype=torch.bfloat16) if autocast
                else contextlib.nullcontext())
        with ctx, self._head(fp32_head), cast:
            logits = self.model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
        return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1).cpu()

    def update(self, algo, ids: torch.Tensor, prompt_len: int, fp32_head: bool, old_logp: torch.Tensor,
               advantages: torch.Tensor, mask: torch.Tensor, weights, mini_batches: int) -> Dict[str, Any]:
        """One PPO epoch over `mini_batches` mini-batches (rows in order: GRPO groups stay together),
        each one optimizer step on verl's policy loss. Also records, for the TIS check, the loss verl's
        function gives on the same tensors without the weights."""
        self.model.train()
        b = ids.shape[0]
        size = -(-b // mini_batches)
        losses: List[float] = []
        unweighted: List[float] = []
        metrics: List[Dict[str, Any]] = []
        grad_norms: List[float] = []
        for start in range(0, b, size):
            sl = slice(start, start + size)
            logp = self.logp(ids[sl], prompt_len, fp32_head, grad=True)
            w = weights[sl] if weights is not None else None
            loss, pm = algo.policy_loss(old_logp[sl], logp, advantages[sl], mask[sl], w)
            if w is not None:
                with torch.no_grad():
                    plain, _ = algo.policy_loss(old_logp[sl], logp.detach(), advantages[sl], mask[sl], None)
                unweighted.append(float(plain))
            loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)))
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            metrics.append(pm)
        self.model.eval()
        out: Dict[str, Any] = {"loss": sum(losses) / len(losses), "grad_norm": max(grad_norms),
                               "pg_clipfrac": max(float(m.get("actor/pg_clipfrac", 0.0)) for m in metrics)}
        if unweighted:
            out["loss_without_tis"] = sum(unweighted) / len(unweighted)
        return out

    def snapshot(self) -> List[Tuple[str, torch.Tensor]]:
        """The bf16 weights the trainer syncs (HF names)."""
        return [(n, p.detach().to(torch.bfloat16).clone()) for n, p in self.model.named_parameters()]
