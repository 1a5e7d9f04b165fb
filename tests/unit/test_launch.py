"""launch/ scripts share one shape and pass shellcheck; the cluster check parses hostfiles strictly."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dstrain.cluster import Host, parse_hostfile
from dstrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "launch").glob("*.sh")) + [ROOT / "launch/slurm.sbatch"]
ENTRY_SCRIPTS = [p for p in SCRIPTS if p.name != "common.sh"]


def test_scripts_pass_shellcheck():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed (make test installs it with apt-get as root)")
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script", ENTRY_SCRIPTS, ids=lambda p: p.name)
def test_scripts_share_one_shape(script):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text and "launch/common.sh" in text
    assert "Knobs" in text  # each documents its environment variables at the top
    launcher_lines = [line for line in text.splitlines() if line.lstrip().startswith(
        ("exec \"$PYTHON\" -m deepspeed", "\"$PYTHON\" -m deepspeed", "srun "))]
    assert len(launcher_lines) == 1, launcher_lines  # exactly one launcher command


def test_hostfile_with_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# head\n\nnode-1 slots=8   # the first\nnode-2.example.com slots=4\n10.0.0.3 slots=1\n")
    assert parse_hostfile(path) == [Host("node-1", 8), Host("node-2.example.com", 4), Host("10.0.0.3", 1)]


@pytest.mark.parametrize("text,message", [
    ("node1 slots=8\nnode2\n", "hostfile:2: 'node2' is not 'HOST slots=N'"),
    ("node1 slots=0\n", "slots=0 must be a positive integer"),
    ("node1 slots=8\nnode1 slots=8\n", "host node1 is listed twice"),
    ("# nothing\n", "lists no hosts"),
])
def test_bad_hostfiles_are_named_by_line(tmp_path, text, message):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        parse_hostfile(path)


def test_missing_hostfile_points_at_the_example(tmp_path):
    with pytest.raises(UserError, match="launch/hostfile.example"):
        parse_hostfile(tmp_path / "nope")


def test_shipped_example_hostfile_parses():
    assert [h.slots for h in parse_hostfile(ROOT / "launch/hostfile.example")] == [8, 8]


def test_stale_op_build_locks_are_removed_fresh_ones_kept(tmp_path, monkeypatch):
    import os
    import time

    from dstrain.dist import clear_stale_build_locks
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "py311_cpu/async_io/lock", tmp_path / "py311_cpu/cpu_adam/lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.write_text("")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    clear_stale_build_locks()
    assert not stale.exists() and fresh.exists()
