"""dist.leave: a finished rank skips interpreter teardown (os._exit) without losing its output or exit code."""
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import logging, os, sys, threading, time
import torch.distributed as tdist
from dstrain.parallel import dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
tdist.init_process_group("gloo", rank=0, world_size=1)
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # would not stop an exit either
sys.stdout.write("buffered stdout, no newline")  # a pipe is block-buffered: lost by a bare os._exit
logging.getLogger("x").info("a log record")
dist.leave(int(sys.argv[2]))
print("not reached")
"""


def test_leave_flushes_output_and_keeps_the_exit_code():
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as under a plain launcher
    for code in (0, 75):
        proc = subprocess.run([sys.executable, "-c", PROGRAM, str(free_port()), str(code)], cwd=ROOT, env=buffered,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr[-2000:]
        assert proc.stdout == "buffered stdout, no newline"
        assert "a log record" in proc.stderr and "not reached" not in proc.stdout


def test_ctrl_c_before_the_first_step_is_one_line_and_exit_130(capsys, monkeypatch):
    """Issue 16: Ctrl-C gave KeyboardInterrupt tracebacks. Before training starts there is nothing to save."""
    import pytest

    from dstrain import cli
    from dstrain.errors import EXIT_INTERRUPTED

    monkeypatch.delenv("RANK", raising=False)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stop:
        cli.exit_with(interrupted)
    assert stop.value.code == EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err
    assert err == "interrupted before training started; nothing was saved\n"
