"""npu_flashrl's logging: `npu_flashrl.<module>` loggers that propagate to the root (a user's or
verl's logging config sees our lines), a handler of our own only when FLASHRL_LOGGING_LEVEL /
FLASHRL_LOGGING_FILE ask for one (then nothing is printed twice).

Each case runs in its own interpreter (the variables are read once, when the first logger is
made). The lines are real ones: the patch registry's DEBUG "patched" line and WARNING "cannot
patch" line, from a patch that applies and one that refuses. No stand-ins.
"""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE = os.path.join(ROOT, "npu_flashrl")

pytestmark = pytest.mark.every_line

_DRIVER = textwrap.dedent("""
    import logging, sys
    if sys.argv[1] == "root":  # the host's logging config (as verl's or a user's basicConfig)
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="ROOT|%(name)s|%(levelname)s|%(message)s")
    from npu_flashrl import patches

    @patches.register("fence_ok", "nothing:ok", "any")
    def _ok():
        pass

    @patches.register("fence_refused", "nothing:refused", "any")
    def _refused():
        raise patches.PatchNotApplicable("no target here")

    patches.apply_patch("fence_ok")
    patches.apply_patch("fence_refused")
    ours = logging.getLogger("npu_flashrl")
    print("HANDLERS", len(ours.handlers), "PROPAGATE", ours.propagate, "LOGGER", patches.logger.name)
""")


def _run(mode, tmp_path, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "NPU_FLASHRL_"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               **{k: str(v) for k, v in env_extra.items()})
    p = subprocess.run([sys.executable, "-c", _DRIVER, mode], capture_output=True, text=True, timeout=60,
                       env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, p.stderr


def test_host_root_config_sees_our_lines_by_default(tmp_path):
    out, err = _run("root", tmp_path)
    assert "HANDLERS 0 PROPAGATE True LOGGER npu_flashrl.patches" in out
    assert out.count("ROOT|npu_flashrl.patches|DEBUG|npu_flashrl: patched fence_ok -> nothing:ok") == 1
    assert out.count("ROOT|npu_flashrl.patches|WARNING|npu_flashrl: cannot patch fence_refused") == 1
    assert "fence_" not in err  # nothing printed a second time by a handler of ours


def test_without_any_config_warnings_still_reach_stderr(tmp_path):
    out, err = _run("bare", tmp_path)
    assert "HANDLERS 0 PROPAGATE True" in out
    assert "cannot patch fence_refused" in err  # Python's last-resort handler (WARNING and above)
    assert "patched fence_ok" not in err


def test_logging_file_gets_our_lines_once(tmp_path):
    log = tmp_path / "flashrl.log"
    out, err = _run("root", tmp_path, FLASHRL_LOGGING_FILE=log, FLASHRL_LOGGING_LEVEL="DEBUG")
    assert "HANDLERS 1 PROPAGATE False" in out
    text = log.read_text()
    assert text.count("DEBUG npu_flashrl.patches: npu_flashrl: patched fence_ok -> nothing:ok") == 1
    assert text.count("WARNING npu_flashrl.patches: npu_flashrl: cannot patch fence_refused") == 1
    assert "fence_" not in out.replace("HANDLERS", "") and "fence_" not in err  # not printed twice


def test_logging_file_alone_logs_at_info(tmp_path):
    log = tmp_path / "flashrl.log"
    _run("bare", tmp_path, FLASHRL_LOGGING_FILE=log)
    text = log.read_text()
    assert "cannot patch fence_refused" in text and "patched fence_ok" not in text  # FlashRL's default: INFO


def test_logging_level_installs_a_stderr_handler(tmp_path):
    out, err = _run("root", tmp_path, FLASHRL_LOGGING_LEVEL="debug")
    assert "HANDLERS 1 PROPAGATE False" in out and "ROOT|npu_flashrl" not in out
    assert err.count("DEBUG npu_flashrl.patches: npu_flashrl: patched fence_ok -> nothing:ok") == 1


def test_bad_logging_level_warns_and_uses_info(tmp_path):
    out, err = _run("bare", tmp_path, FLASHRL_LOGGING_LEVEL="LOUD")
    assert "FLASHRL_LOGGING_LEVEL='LOUD' is not a logging level; using INFO" in err
    assert "cannot patch fence_refused" in err and "patched fence_ok" not in err


def test_logging_file_fifo_is_refused_by_name_not_opened(tmp_path):
    """A FIFO as FLASHRL_LOGGING_FILE: opening it for writing waits for a reader forever (every
    process importing npu_flashrl, vLLM workers and Ray hooks included, hung at import). Named and
    refused unopened, lines go to stderr; a character device (/dev/null) is still a fine target."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    out, err = _run("bare", tmp_path, FLASHRL_LOGGING_FILE=fifo)  # a hang fails by _run's timeout
    assert f"FLASHRL_LOGGING_FILE='{fifo}': is a FIFO (named pipe), not a regular file" in err
    assert "logging to stderr" in err and "cannot patch fence_refused" in err
    out, err = _run("bare", tmp_path, FLASHRL_LOGGING_FILE="/dev/null")
    assert "HANDLERS 1 PROPAGATE False" in out and err == ""


def _logger_calls():
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "get_logger":
                        yield os.path.relpath(path, ROOT), node


def test_every_module_logs_under_its_own_dotted_name():
    """`get_logger(__name__)` (or `__package__` for a package's one logger, or no argument for the
    `npu_flashrl` logger itself): no two modules share a hand-written name."""
    bad = []
    calls = list(_logger_calls())
    for path, node in calls:
        args = node.args
        ok = not args or (isinstance(args[0], ast.Name) and args[0].id in ("__name__", "__package__"))
        if not ok:
            bad.append(f"{path}:{node.lineno}: get_logger({ast.unparse(args[0])})")
    assert len(calls) >= 15 and not bad, "\n".join(bad)
