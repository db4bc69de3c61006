"""Rollout-vs-trainer mismatch metrics (pure torch, masked, batched).

Inputs everywhere are ``[B, T]`` tensors (a 1-D ``[T]`` tensor is treated as one row):

* ``logp_train``   -- log pi_train(y_t), the trainer's log-prob of the sampled token (verl: ``old_log_probs``)
* ``logp_rollout`` -- log pi_rollout(y_t), the rollout engine's log-prob of the same token
  (verl: ``rollout_log_probs``)
* ``mask``         -- valid-token mask (bool, int or float; a token is valid when ``mask > 0``).

Conventions (the same in every function):

* ``d = logp_train - logp_rollout`` is the per-token log-ratio log(pi_train / pi_rollout).
* Only valid tokens enter any statistic. Values at masked positions are ignored even when they are
  ``-inf``/``NaN`` (padding). A NaN at a *valid* position propagates (it is a real problem).
* Everything is computed in float64 on the input's device and returned as Python floats.
* **Clamp.** Every exponentiated log-ratio is clamped first to ``[-LOG_RATIO_CLAMP, +LOG_RATIO_CLAMP]``
  with ``LOG_RATIO_CLAMP = 20`` (verl's ``SAFETY_BOUND``: exp(20) ~ 4.85e8), so a log-ratio of
  +-1000 gives large but finite numbers, never inf/NaN. Linear terms (k1, the ``-d`` in k3) use the raw
  ``d``. Probabilities are ``exp(min(logp, 0))`` (a log-prob above 0 is invalid input).
* **Empty input.** An all-masked batch makes every statistic ``NaN`` (``valid_tokens`` = 0); it never
  raises. All-masked rows are ignored by token statistics and excluded from sequence statistics
  (they have no sequence weight). A statistic needing two values (std, Pearson) is ``NaN`` when it
  has fewer, except ``prob_diff_std`` which is 0.0 for exactly one valid token; Pearson is ``NaN``
  when either side has zero variance.

The one entry point is :func:`mismatch_metrics`; :func:`tis_weights` returns the truncated IS weights
themselves (equal to verl's ``compute_rollout_correction_weights`` without batch normalisation).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

LOG_RATIO_CLAMP = 20.0

__all__ = [
    "LOG_RATIO_CLAMP",
    "mismatch_metrics",
    "tis_weights",
    "token_mult_prob_error",
    "metric_names",
]

_NAN = float("nan")


def _prepare(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate shapes; return (logp_train, logp_rollout) in float64 with masked slots zeroed, bool mask."""
    if not (isinstance(logp_train, torch.Tensor) and isinstance(logp_rollout, torch.Tensor)
            and isinstance(mask, torch.Tensor)):
        raise TypeError("logp_train, logp_rollout and mask must be torch tensors")
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp_train {tuple(logp_train.shape)}, logp_rollout "
                         f"{tuple(logp_rollout.shape)}, mask {tuple(mask.shape)} must be equal")
    if logp_train.dim() == 1:
        logp_train, logp_rollout, mask = logp_train[None], logp_rollout[None], mask[None]
    if logp_train.dim() != 2:
        raise ValueError(f"expected [B, T] (or [T]) tensors, got {logp_train.dim()} dims")
    device = logp_train.device
    valid = (mask.to(device) > 0) if mask.dtype != torch.bool else mask.to(device)
    lt = logp_train.detach().to(torch.float64)
    lr = logp_rollout.detach().to(device=device, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    lt = torch.where(valid, lt, zero)
    lr = torch.where(valid, lr, zero)
    return lt, lr, valid


def _masked_mean(x: torch.Tensor, valid: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, torch.zeros_like(x)).sum() / n  # n == 0 -> 0/0 -> NaN


def tis_weights(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                level: str = "token", threshold: float = 2.0) -> torch.Tensor:
    """Truncated importance-sampling weights, ``[B, T]``, zero at masked positions.

    * token:    ``w_t = min(exp(clamp(d_t, -20, 20)), C)``
    * sequence: ``s = sum over valid t of d_t`` (log space), ``w = min(exp(clamp(s, -20, 20)), C)``
      broadcast over the row's valid tokens.

    ``d = logp_train - logp_rollout`` (verl: old_log_prob - rollout_log_prob), ``C = threshold``.
    This is verl's ``compute_rollout_correction_weights(..., rollout_is_batch_normalize=False)``.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    lt, lr, valid = _prepare(logp_train, logp_rollout, mask)
    d = lt - lr
    if level == "token":
        w = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    elif level == "sequence":
        s = d.sum(dim=-1, keepdim=True)
        w = torch.exp(s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(d)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    w = w.clamp(max=float(threshold))
    out = torch.where(valid, w, torch.zeros_like(w))
    if logp_train.dim() == 1:
        out = out[0]
    return out


def token_mult_prob_error(logp_train: torch.Tensor, logp_rollout: torch.Tensor,
                          mask: torch.Tensor) -> float:
    """mean over valid tokens of ``exp(min(|logp_train - logp_rollout|, 20))``; 1.0 is a perfect match."""
    lt, lr, valid = _prepare(logp_train, logp_rollout, mask)
    n = valid.sum().to(torch.float64)
    return float(_masked_mean(torch.exp((lt - lr).abs().clamp(max=LOG_RATIO_CLAMP)), valid, n))


def _ess(w: torch.Tensor, valid: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size (sum w)^2 / (n * sum w^2), in (0, 1]; NaN when empty or all w == 0."""
    w = torch.where(valid, w, torch.zeros_like(w))
    return w.sum() ** 2 / (n * (w * w).sum())


def metric_names(prefix: str = "npu_flashrl/") -> list:
    """The keys :func:`mismatch_metrics` returns, in order."""
    return [prefix + k for k in _KEYS]


_KEYS = (
    "token_mult_prob_error",
    "kl_k1",
    "kl_k3",
    "prob_diff_max",
    "prob_diff_mean",
    "prob_diff_std",
    "prob_pearson",
    "tis_token_mean",
    "tis_token_max",
    "tis_token_frac_truncated",
    "tis_token_ess",
    "tis_seq_mean",
    "tis_seq_max",
    "tis_seq_frac_truncated",
    "tis_seq_ess",
    "tis_threshold",
    "valid_tokens",
    "valid_seqs",
)


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                     tis_threshold: float = 2.0, prefix: str = "npu_flashrl/") -> Dict[str, float]:
    """All mismatch metrics of a batch as ``{prefix + name: float}``.

    With ``d = logp_train - logp_rollout``, ``dc = clamp(d, -20, 20)``, ``n`` = number of valid tokens,
    means over valid tokens unless stated:

    * ``token_mult_prob_error`` = mean(exp(|dc|)). 1.0 is perfect; ~1.03-1.05 is the accepted band.
    * ``kl_k1`` = mean(logp_rollout - logp_train) = mean(-d): KL(rollout || train), k1 estimator
      (unbiased, can be negative on a finite sample). Same as verl's ``rollout_corr/kl``.
    * ``kl_k3`` = mean(exp(dc) - 1 - d), floored at 0 per token: KL(rollout || train), k3 estimator
      (verl's ``rollout_corr/k3_kl``; identical whenever |d| <= 20).
    * ``prob_diff_{max,mean,std}`` of |p_train - p_rollout| with p = exp(min(logp, 0)); std is the
      sample std (n - 1), 0.0 for a single valid token (verl's ``training/rollout_probs_diff_*``).
    * ``prob_pearson``: Pearson correlation of p_train and p_rollout over valid tokens.
    * Token TIS at ``C = tis_threshold``, raw weight ``r = exp(dc)``, used weight ``w = min(r, C)``:
      ``tis_token_mean`` = mean(w) (the weights the loss sees), ``tis_token_max`` = max(r) (before
      truncation, so at most exp(20)), ``tis_token_frac_truncated`` = fraction with r > C,
      ``tis_token_ess`` = (sum w)^2 / (n * sum w^2) in (0, 1] (1 = all weights equal).
    * Sequence TIS over rows with at least one valid token (m of them): ``s = sum_t d_t`` in log space,
      ``r = exp(clamp(s, -20, 20))``, ``w = min(r, C)``; ``tis_seq_mean`` = mean(w), ``tis_seq_max`` =
      max(r), ``tis_seq_frac_truncated`` = fraction with s > log C, ``tis_seq_ess`` = (sum w)^2 / (m sum w^2).
    * ``tis_threshold`` = C, ``valid_tokens`` = n, ``valid_seqs`` = m.

    An all-masked batch returns NaN for every statistic (0 for the counts); see the module docstring.
    """
    if tis_threshold <= 0:
        raise ValueError(f"tis_threshold must be positive, got {tis_threshold}")
    lt, lr, valid = _prepare(logp_train, logp_rollout, mask)
    f64 = dict(dtype=torch.float64, device=lt.device)
    n_tokens = int(valid.sum())
    if n_tokens == 0:  # all-masked batch: defined result, never an error
        res = {prefix + k: _NAN for k in _KEYS}
        res.update({prefix + "tis_threshold": float(tis_threshold), prefix + "valid_tokens": 0.0,
                    prefix + "valid_seqs": 0.0})
        return res
    zeros = torch.zeros_like(lt)
    n = torch.tensor(float(n_tokens), **f64)
    d = lt - lr
    dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    nan = torch.tensor(_NAN, **f64)

    def mmax(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, torch.full_like(x, -math.inf)).max()

    out: Dict[str, torch.Tensor] = {}
    out["token_mult_prob_error"] = _masked_mean(torch.exp(dc.abs()), valid, n)
    out["kl_k1"] = _masked_mean(-d, valid, n)
    out["kl_k3"] = _masked_mean((torch.exp(dc) - 1.0 - d).clamp(min=0.0), valid, n)

    p_train = torch.exp(lt.clamp(max=0.0))
    p_roll = torch.exp(lr.clamp(max=0.0))
    pdiff = (p_train - p_roll).abs()
    out["prob_diff_max"] = mmax(pdiff)
    mean_pd = _masked_mean(pdiff, valid, n)
    out["prob_diff_mean"] = mean_pd
    if n_tokens == 1:
        out["prob_diff_std"] = torch.zeros((), **f64)
    else:
        out["prob_diff_std"] = (torch.where(valid, (pdiff - mean_pd) ** 2, zeros).sum() / (n - 1.0)).sqrt()

    mt, mr = _masked_mean(p_train, valid, n), _masked_mean(p_roll, valid, n)
    ct = torch.where(valid, p_train - mt, zeros)
    cr = torch.where(valid, p_roll - mr, zeros)
    denom = ((ct * ct).sum() * (cr * cr).sum()).sqrt()
    # zero variance on either side (or a single token) -> NaN; no data-dependent branch on device
    out["prob_pearson"] = torch.where(denom > 0, (ct * cr).sum() / denom, nan)

    C = float(tis_threshold)
    r_tok = torch.exp(dc)
    w_tok = r_tok.clamp(max=C)
    out["tis_token_mean"] = _masked_mean(w_tok, valid, n)
    out["tis_token_max"] = mmax(r_tok)
    out["tis_token_frac_truncated"] = _masked_mean((r_tok > C).to(torch.float64), valid, n)
    out["tis_token_ess"] = _ess(w_tok, valid, n)

    row_valid = valid.any(dim=-1)
    m = row_valid.sum().to(torch.float64)
    s = d.sum(dim=-1)  # masked slots are zero
    r_seq = torch.exp(s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    w_seq = r_seq.clamp(max=C)
    # n_tokens > 0 here, so at least one row is valid
    out["tis_seq_mean"] = _masked_mean(w_seq, row_valid, m)
    out["tis_seq_max"] = torch.where(row_valid, r_seq, torch.full_like(r_seq, -math.inf)).max()
    out["tis_seq_frac_truncated"] = _masked_mean((s > math.log(C)).to(torch.float64), row_valid, m)
    out["tis_seq_ess"] = _ess(w_seq, row_valid, m)

    out["tis_threshold"] = torch.tensor(C, **f64)
    out["valid_tokens"] = n
    out["valid_seqs"] = m
    values = torch.stack([out[k].to(**f64).reshape(()) for k in _KEYS]).tolist()  # one transfer for all values
    return {prefix + k: float(v) for k, v in zip(_KEYS, values)}
