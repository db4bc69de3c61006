"""Test-order dependences found so far, held by running the pair in one pytest process in the
order that broke (no stand-ins: pytest itself in a subprocess, on this checkout).

- tests/adapters/verl/test_verl_server_tis.py stubbed HF `datasets` in sys.modules (verl's losses
  import it; the CPU stack lacks it) and left the stub there; the Megatron pin's fixture then asked
  `importlib.util.find_spec("datasets")`, which raises on a module without `__spec__`."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_the_megatron_pin_runs_after_the_verl_tis_tests_in_one_process():
    first = ("tests/adapters/verl/test_verl_server_tis.py::"
             "test_recommended_overrides_multiply_is_weights_into_the_workers_loss")
    then = "tests/adapters/megatron/test_megatron_verl_pin.py::test_fsdp_worker_imports_on_npu_without_mindspeed"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           first, then], cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert "2 passed" in tail or ("1 passed" in tail and "1 skipped" in tail), tail
