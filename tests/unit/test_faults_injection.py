"""dstrain/run/faults.py: the injection the fault tests rely on."""
import os
import signal
import threading
import time
from types import SimpleNamespace

from dstrain.run import faults, preempt


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


def test_slow_until_signalled_holds_the_step_until_a_signal_asks_the_rank_to_stop(monkeypatch, tmp_path):
    """The elastic lost-and-back test holds the lone world's step this way until its agent stops it (SIGTERM)."""
    monkeypatch.setattr(faults, "_RULES", faults._parse("step:slow:seconds=30:until=signalled:step=4"))
    monkeypatch.setattr(faults, "_RELEASED", {})
    monkeypatch.setattr(preempt, "LAUNCHERS", [])
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        stop = preempt.StopRequest(tmp_path, SimpleNamespace(is_main=True))
        began = time.monotonic()
        faults.point("step", 0, 3)  # not the held step: no wait
        assert time.monotonic() - began < 0.5
        threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
        began = time.monotonic()
        faults.point("step", 0, 4)  # would sleep 30 s without the signal
        assert 0.2 < time.monotonic() - began < 10 and stop.reason == "SIGUSR1"
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
