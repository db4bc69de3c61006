"""Process marks: attributes npu_flashrl sets on upstream objects (a layer, a model, a wrapper)
to remember what it did to them (`_npu_flashrl_policy`, `_npu_flashrl_processed`, the fp32
lm-head marks, ...).

A mark is read by identity, `is True`: a `unittest.mock.MagicMock` (upstream's own unit tests
build layers from them) answers every attribute with a truthy child mock, so `getattr(layer,
mark, False)` would take a mock layer for one npu_flashrl already processed. Set marks with
`set_mark` (the value `True`) and read them with `marked`.
"""
from __future__ import annotations


def marked(obj, name: str) -> bool:
    """`obj` carries the mark `name` (set to exactly True by npu_flashrl)."""
    return getattr(obj, name, None) is True


def set_mark(obj, name: str) -> None:
    setattr(obj, name, True)
