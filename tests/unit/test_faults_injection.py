"""dstrain/faults.py: the injection the fault tests rely on."""
import threading
import time

from dstrain import faults


def test_slow_until_an_event_stops_slowing_when_the_code_releases_it(monkeypatch):
    monkeypatch.setattr(faults, "_RULES", faults._parse("step:slow:seconds=30:until=compiled"))
    monkeypatch.setattr(faults, "_RELEASED", {})
    assert faults._RULES == [("step", "slow", {"seconds": 30, "until": "compiled"})]
    threading.Timer(0.3, faults.release, args=("compiled",)).start()
    began = time.monotonic()
    faults.point("step", 0, 1)  # would sleep 30 s without the release
    assert 0.2 < time.monotonic() - began < 10
    began = time.monotonic()
    faults.point("step", 0, 2)  # released: the later steps are not slowed
    assert time.monotonic() - began < 0.5


def test_plain_slow_sleeps_its_seconds(monkeypatch):
    monkeypatch.setattr(faults, "_RULES", faults._parse("step:slow:seconds=0:rank=1"))
    assert faults._RULES == [("step", "slow", {"seconds": 0, "rank": 1})]
    faults.point("step", 1, 3)
