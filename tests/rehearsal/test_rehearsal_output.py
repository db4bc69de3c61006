"""The rehearsal's per-step table reads each sync's state check under `rollout_state` (the key
report.json's `steps` and `rollout_state` share whatever the precision: INT8 and W4A8 alike).
No stand-ins: rows in the shape `rehearsal.rollout` records them."""
from npu_flashrl.rehearsal.output import TABLE_COLUMNS, format_table

METRICS = {"token_mult_prob_error": 1.01, "kl_k1": 1e-4, "kl_k3": 1e-4, "prob_diff_max": 0.02}


def _row(variant, state):
    return {"step": 1, "variant": variant, "metrics": METRICS, "reload_s": 0.1, "rollout_state": state}


def test_the_step_table_shows_every_precisions_state_under_rollout_state():
    rows = [_row("bf16", None),
            _row("int8", {"ok": True, "failing": [], "output_rel_error_max": 0.0109}),
            _row("w4a8", {"ok": False, "failing": ["int4"], "output_rel_error_max": 0.0312})]
    assert "rollout_state" in TABLE_COLUMNS and "int8_state" not in TABLE_COLUMNS
    text = format_table(rows)
    header, _, *body = text.splitlines()
    assert header.split()[6] == "rollout_state"
    cells = {line.split()[1]: line.split()[6:8] for line in body}
    assert cells == {"bf16": ["-", "-"], "int8": ["exact", "0.0109"], "w4a8": ["FAIL:int4", "0.0312"]}
