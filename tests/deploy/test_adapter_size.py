"""The vllm-ascend adapter stays in small rooms: no class of `npu_flashrl/adapters/vllm_ascend/`
is over 200 lines (read with `ast`, nothing imported)."""
import ast
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ADAPTER = os.path.join(ROOT, "npu_flashrl", "adapters", "vllm_ascend")
LIMIT = 200

pytestmark = pytest.mark.every_line


def test_no_class_of_the_vllm_ascend_adapter_is_over_200_lines():
    big = []
    for dirpath, _, files in os.walk(ADAPTER):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.ClassDef):
                        size = node.end_lineno - node.lineno + 1
                        if size > LIMIT:
                            big.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({size} lines)")
    assert not big, big
