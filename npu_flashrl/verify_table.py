"""One row of `npu-flashrl verify`'s table (check, status, detail, fix) and its statuses, shared
by the environment checks (`verify`) and the FlashRL config's (`verify_config`)."""
from __future__ import annotations

from typing import Dict

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"


def _row(check: str, status: str, detail: str, fix: str = "") -> Dict[str, str]:
    return {"check": check, "status": status, "detail": detail, "fix": fix}
