"""events.jsonl: a row per launch, and the cost of a change of members (dstrain/run/events.py)."""
from __future__ import annotations

import json

from dstrain.parallel.dist import DistContext
from dstrain.run import events


def test_a_changed_membership_is_one_line_and_a_row(tmp_path, monkeypatch):
    ctx = DistContext(0, 0, 1)
    said = []
    monkeypatch.setattr(events.os, "getppid", lambda: 111)
    first = events.record_start(tmp_path, ctx, 0, said.append)
    assert first["world_size"] == 1 and len(first["nodes"]) == 1 and not said
    # the first launch logged 12 steps of 0.5 s each, the newest checkpoint is step 8; then it was lost
    rows = [{"step": s, "loss": 1.0, "time": first["time"] - 10 + 0.5 * s, "step_s": 0.5} for s in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(events.os, "getppid", lambda: 222)  # another launcher process: another node
    again = events.record_start(tmp_path, ctx, 8, said.append)
    assert again["steps_recomputed"] == 4 and again["left"] == first["nodes"] and again["joined"] == again["nodes"]
    assert again["seconds_lost"] >= 6.0  # the 4 steps (2 s), plus the wall time since step 12 (4 s or more)
    assert len(said) == 1 and "4 step(s) recomputed" in said[0] and "world 1 -> 1" in said[0]
    starts = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["step"] for r in starts] == [0, 8]
    events.record_start(tmp_path, ctx, 12, said.append)  # the same members: a row, nothing said
    assert len(said) == 1


def test_a_start_after_a_stop_counts_no_time_lost(tmp_path, monkeypatch):
    """Issue 54 item 7: a resume after Ctrl-C said "membership changed ... 450.6 s lost". A checkpointed stop
    (a person, a scheduler, an elastic agent re-forming the world) is a pause: said as such, nothing lost; a world
    that grew meanwhile is still recorded (who joined)."""
    said = []
    monkeypatch.setattr(events.os, "getppid", lambda: 111)
    events.record_start(tmp_path, DistContext(0, 0, 1), 0, said.append)
    rows = [{"step": s, "loss": 1.0, "time": 1.0 + s, "step_s": 0.5} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events.record_stop(tmp_path, DistContext(0, 0, 1), 5, "SIGINT")
    monkeypatch.setattr(events, "all_gather_objects", lambda mine: [mine, "other/333"])  # a second node joined
    monkeypatch.setattr(events.os, "getppid", lambda: 222)
    again = events.record_start(tmp_path, DistContext(0, 0, 2), 5, said.append)
    assert said == ["resumed after a stop (SIGINT) at step 5; world 1 -> 2; nothing recomputed"]
    assert again["seconds_lost"] == 0.0 and again["steps_recomputed"] == 0 and again["after_stop"] == "SIGINT"
    assert "other/333" in again["joined"] and again["paused_s"] >= 0
    # a stop at another step than the start (a checkpoint lost after it) is no pause: a fault's accounting
    monkeypatch.setattr(events.os, "getppid", lambda: 444)
    third = events.record_start(tmp_path, DistContext(0, 0, 2), 3, said.append)
    assert "after_stop" not in third and third["steps_recomputed"] == 2 and said[-1].startswith("membership changed")
