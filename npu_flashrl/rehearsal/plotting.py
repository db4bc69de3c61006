"""The rehearsals' plots: matplotlib (optional, headless) and one way to finish and write a figure."""
from __future__ import annotations

import io
from typing import Any, Optional


def pyplot() -> Optional[Any]:
    """matplotlib.pyplot on the Agg backend (no screen), or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_png(plt: Any, fig: Any, axes, xlabel: str, path: str) -> str:
    """Label, grid and legend every axis, then write `path` atomically (a failed write keeps the
    previous plot)."""
    from npu_flashrl.config import atomic_write

    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()), binary=True)
    return path
