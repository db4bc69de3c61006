"""npu_flashrl.metrics against hand-computed values (masks, all-masked rows/batches, extreme ratios)."""
import math

import pytest
import torch

from npu_flashrl.metrics import (LOG_RATIO_CLAMP, metric_names, mismatch_metrics, tis_weights,
                                 token_mult_prob_error)

P = "npu_flashrl/"


def _batch():
    # Row 0: three valid tokens; row 1: one valid token then padding (garbage -inf / nan in padding)
    lt = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -float("inf"), float("nan")]])
    lr = torch.tensor([[-1.1, -1.5, -0.5], [-0.3, 0.0, -7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return lt, lr, mask


def test_hand_computed_values():
    lt, lr, mask = _batch()
    m = mismatch_metrics(lt, lr, mask, tis_threshold=1.2)
    # valid d = lt - lr: 0.1, -0.5, 0.0, 0.2
    d = [0.1, -0.5, 0.0, 0.2]
    assert m[P + "valid_tokens"] == 4 and m[P + "valid_seqs"] == 2
    assert m[P + "token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in d) / 4, rel=1e-6)
    assert m[P + "token_mult_prob_error"] == pytest.approx(1.2438237, rel=1e-6)
    assert m[P + "kl_k1"] == pytest.approx(-sum(d) / 4, abs=1e-7)  # = 0.05
    assert m[P + "kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4, rel=1e-6)
    pt = [math.exp(-1.0), math.exp(-2.0), math.exp(-0.5), math.exp(-0.1)]
    pr = [math.exp(-1.1), math.exp(-1.5), math.exp(-0.5), math.exp(-0.3)]
    diffs = [abs(a - b) for a, b in zip(pt, pr)]
    mean = sum(diffs) / 4
    assert m[P + "prob_diff_max"] == pytest.approx(max(diffs), rel=1e-6)
    assert m[P + "prob_diff_mean"] == pytest.approx(mean, rel=1e-6)
    assert m[P + "prob_diff_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in diffs) / 3), rel=1e-5)
    mt, mr = sum(pt) / 4, sum(pr) / 4
    cov = sum((a - mt) * (b - mr) for a, b in zip(pt, pr))
    pear = cov / math.sqrt(sum((a - mt) ** 2 for a in pt) * sum((b - mr) ** 2 for b in pr))
    assert m[P + "prob_pearson"] == pytest.approx(pear, rel=1e-5)
    # token TIS at C = 1.2: raw weights exp(d) = 1.10517, 0.60653, 1, 1.22140 -> last one truncated
    raw = [math.exp(x) for x in d]
    w = [min(x, 1.2) for x in raw]
    assert m[P + "tis_token_mean"] == pytest.approx(sum(w) / 4, rel=1e-6)
    assert m[P + "tis_token_max"] == pytest.approx(math.exp(0.2), rel=1e-6)
    assert m[P + "tis_token_frac_truncated"] == pytest.approx(0.25)
    assert m[P + "tis_token_ess"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)), rel=1e-6)
    # sequence TIS: s0 = 0.1 - 0.5 + 0 = -0.4, s1 = 0.2 (padding ignored)
    ws = [math.exp(-0.4), min(math.exp(0.2), 1.2)]
    assert m[P + "tis_seq_mean"] == pytest.approx(sum(ws) / 2, rel=1e-6)
    assert m[P + "tis_seq_max"] == pytest.approx(math.exp(0.2), rel=1e-6)
    assert m[P + "tis_seq_frac_truncated"] == pytest.approx(0.5)
    assert m[P + "tis_seq_ess"] == pytest.approx(sum(ws) ** 2 / (2 * sum(x * x for x in ws)), rel=1e-6)
    assert m[P + "tis_threshold"] == 1.2
    assert all(math.isfinite(v) for v in m.values())


def test_keys_prefix_and_identity():
    lt = torch.randn(3, 5).clamp(max=0) - 0.1
    mask = torch.ones(3, 5)
    m = mismatch_metrics(lt, lt.clone(), mask, prefix="x/")
    assert list(m) == metric_names("x/")
    assert m["x/token_mult_prob_error"] == 1.0
    assert m["x/kl_k1"] == 0.0 and m["x/kl_k3"] == 0.0
    assert m["x/prob_diff_max"] == 0.0
    assert m["x/prob_pearson"] == pytest.approx(1.0)
    assert m["x/tis_token_mean"] == 1.0 and m["x/tis_token_ess"] == pytest.approx(1.0)
    assert m["x/tis_seq_frac_truncated"] == 0.0


def test_all_masked_row_is_ignored():
    lt, lr, mask = _batch()
    lt2 = torch.cat([lt, torch.full((1, 3), -50.0)])
    lr2 = torch.cat([lr, torch.zeros(1, 3)])
    mask2 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    a = mismatch_metrics(lt, lr, mask, tis_threshold=1.2)
    b = mismatch_metrics(lt2, lr2, mask2, tis_threshold=1.2)
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-12, nan_ok=True), k
    assert b[P + "valid_seqs"] == 2  # the empty row has no sequence weight


def test_all_masked_batch_is_nan_not_error():
    lt, lr, mask = _batch()
    m = mismatch_metrics(lt, lr, torch.zeros_like(mask))
    assert m[P + "valid_tokens"] == 0 and m[P + "valid_seqs"] == 0
    assert m[P + "tis_threshold"] == 2.0
    stats = [k for k in m if not k.endswith(("valid_tokens", "valid_seqs", "tis_threshold"))]
    assert stats and all(math.isnan(m[k]) for k in stats)
    assert math.isnan(token_mult_prob_error(lt, lr, torch.zeros_like(mask)))


def test_extreme_log_ratios_stay_finite():
    lt = torch.tensor([[-1000.0, 0.0, -3.0]])
    lr = torch.tensor([[0.0, -1000.0, -3.0]])
    m = mismatch_metrics(lt, lr, torch.ones(1, 3), tis_threshold=2.0)
    assert all(math.isfinite(v) for v in m.values()), m
    big = math.exp(LOG_RATIO_CLAMP)
    # |d| = 1000, 1000, 0 -> exp clamped at 20
    assert m[P + "token_mult_prob_error"] == pytest.approx((2 * big + 1) / 3, rel=1e-9)
    assert m[P + "kl_k1"] == pytest.approx(0.0, abs=1e-9)  # linear: (1000 - 1000 + 0) / 3
    # k3 terms: exp(-20) - 1 + 1000, exp(20) - 1 - 1000, 0
    assert m[P + "kl_k3"] == pytest.approx((math.exp(-20) + 999 + big - 1001) / 3, rel=1e-9)
    assert m[P + "tis_token_max"] == pytest.approx(big, rel=1e-9)
    assert m[P + "tis_token_frac_truncated"] == pytest.approx(1 / 3)
    assert m[P + "tis_token_mean"] == pytest.approx((math.exp(-20) + 2.0 + 1.0) / 3, rel=1e-9)
    # sequence: s = 0 -> weight 1
    assert m[P + "tis_seq_mean"] == pytest.approx(1.0)
    assert m[P + "prob_diff_max"] == pytest.approx(1.0)


def test_extreme_sequence_sum_overflows_nothing():
    # 200 tokens each with d = +50 -> s = 10000: exp(s) would overflow even in float64
    lt = torch.zeros(2, 200)
    lr = torch.full((2, 200), -50.0)
    lr[1] = 50.0  # row 1: s = -10000 (invalid log-probs > 0 are still handled)
    m = mismatch_metrics(lt, lr, torch.ones(2, 200), tis_threshold=3.0)
    # p_train is constant (all 1.0): Pearson is undefined -> NaN by definition, the rest finite
    assert math.isnan(m.pop(P + "prob_pearson"))
    assert all(math.isfinite(v) for v in m.values()), m
    assert m[P + "tis_seq_frac_truncated"] == 0.5
    assert m[P + "tis_seq_mean"] == pytest.approx((3.0 + math.exp(-20)) / 2, rel=1e-9)
    assert m[P + "tis_seq_max"] == pytest.approx(math.exp(20), rel=1e-9)
    w = tis_weights(lt, lr, torch.ones(2, 200), level="sequence", threshold=3.0)
    assert torch.isfinite(w).all() and w[0, 0] == 3.0


def test_single_token_std_and_pearson():
    m = mismatch_metrics(torch.tensor([[-1.0, 0.0]]), torch.tensor([[-2.0, 0.0]]), torch.tensor([[1, 0]]))
    assert m[P + "prob_diff_std"] == 0.0
    assert math.isnan(m[P + "prob_pearson"])
    assert m[P + "prob_diff_mean"] == pytest.approx(math.exp(-1) - math.exp(-2))


def test_mask_types_and_1d_inputs():
    lt, lr, mask = _batch()
    a = mismatch_metrics(lt, lr, mask)
    b = mismatch_metrics(lt, lr, mask.bool())
    c = mismatch_metrics(lt, lr, mask.float())
    for k in a:
        assert a[k] == pytest.approx(b[k], nan_ok=True) and a[k] == pytest.approx(c[k], nan_ok=True)
    one = mismatch_metrics(lt[0], lr[0], mask[0])
    assert one[P + "valid_tokens"] == 3 and one[P + "valid_seqs"] == 1
    assert tis_weights(lt[0], lr[0], mask[0]).shape == (3,)


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="positive"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), tis_threshold=0)
    with pytest.raises(ValueError, match="level"):
        tis_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), level="geometric")


def test_bf16_inputs_and_grad_tensors():
    lt = (torch.randn(4, 7) * 0.1 - 1).requires_grad_()
    lr = lt.detach().to(torch.bfloat16)
    m = mismatch_metrics(lt, lr, torch.ones(4, 7))
    assert 1.0 <= m[P + "token_mult_prob_error"] < 1.01
