"""launch/ scripts share one shape and pass shellcheck; the cluster check parses hostfiles strictly."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dstrain.cluster import Host, parse_hostfile
from dstrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "launch").glob("*.sh")) + sorted((ROOT / "launch").glob("*.sbatch"))
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
        ("run_with_retries \"$PYTHON\" -m deepspeed", "run_with_retries \"$PYTHON\" -m dstrain.run.elastic_run", "srun ",
         "\"$PYTHON\" -m dstrain.data.prepare_corpus", "\"$PYTHON\" -m dstrain.sweep"))]
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


@pytest.mark.parametrize("codes,want_status,want_calls", [
    ([1, 0], 0, 2),        # a crash, then the resumed attempt finishes
    ([137, 1, 0], 0, 3),   # killed twice: both restarts used
    ([1, 1, 1, 0], 1, 3),  # out of restarts: the last failure is the script's status
    ([2], 2, 1),           # bad input is not retried
    ([74], 74, 1),         # a checkpoint that could not be written (disk full) is not retried
    ([75], 75, 1),         # a requested stop is not retried
])
def test_retry_loop_resumes_and_knows_final_exits(tmp_path, codes, want_status, want_calls):
    """run_with_retries from launch/common.sh around a stand-in launcher that exits with the given codes."""
    fake = tmp_path / "fake.sh"
    fake.write_text("#!/usr/bin/env bash\nn=$(cat calls 2>/dev/null || echo 0); echo $((n + 1)) > calls\n"
                    "echo \"$*\" >> args\ncodes=(" + " ".join(map(str, codes)) + ")\nexit ${codes[$n]}\n")
    fake.chmod(0o755)
    script = (f"source {ROOT / 'launch/common.sh'}; cd {tmp_path}; run_with_retries ./fake.sh --train.x=1")
    proc = subprocess.run(["bash", "-c", script], env=dict(os.environ, MAX_RESTARTS="2", RESTART_DELAY="0",
                                                              NPROC_PER_NODE="1"), capture_output=True, text=True)
    assert proc.returncode == want_status, proc.stderr
    calls = (tmp_path / "args").read_text().splitlines()
    assert len(calls) == want_calls
    assert calls[0] == "--train.x=1" and all(c == "--train.x=1 --resume auto" for c in calls[1:])
