#!/usr/bin/env python3
"""What `make test` prints at its end: the suite's wall time by part, the ten slowest tests of both pytest parts,
and this machine's speed (the fp32 matmul probe train.py's MFU uses, one thread as each CPU rank of the suite runs):
with it a slow day is told from a slow change (docs/testing.md keeps a row per fresh-clone run with the figure).

    python scripts/suite_report.py .suite    # the folder `make test` wrote its timestamps and junit files to
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def slowest(files: list[Path], count: int = 10) -> list[tuple[float, str]]:
    """(seconds, test id) of the slowest test cases in pytest's junit files: setup (where a shared launch's fixture
    runs), call and teardown together, which pytest's --durations lists apart."""
    found = []
    for file in files:
        if not file.is_file():
            continue
        for case in ET.parse(file).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            found.append((float(case.get("time") or 0.0), name))
    return sorted(found, reverse=True)[:count]


def machine_speed() -> float:
    """GFLOP/s of fp32 512x512 matmuls on one thread, best of about 2 s (dstrain.flops.measure_matmul_peak)."""
    import torch

    from dstrain.flops import measure_matmul_peak
    torch.set_num_threads(1)
    return measure_matmul_peak("fp32", torch.device("cpu"), seconds=2.0) / 1e9


def main(folder: Path) -> None:
    stamps = {p.name: float(p.read_text()) for p in folder.glob("*.at")}
    end = max(stamps.values()) if stamps else 0.0
    parts = [("set-up, lint and docs", "started.at", "parallel.at"), ("parallel part", "parallel.at", "serial.at"),
             ("serial part", "serial.at", "ended.at")]
    said = [f"{name} {_clock(stamps[b] - stamps[a])}" for name, a, b in parts if a in stamps and b in stamps]
    print(f"\nsuite: {_clock(end - stamps.get('started.at', end))} wall ({'; '.join(said)}); this machine "
          f"{machine_speed():.1f} GFLOP/s (fp32 matmul, 1 thread: compare docs/testing.md's rows)")
    launches = folder / "launches.log"
    if launches.is_file():  # tests.helpers.launch's: what ran, and what would have run before warm launches
        rows = [line.split("\t") for line in launches.read_text().splitlines() if "\t" in line]
        now, before = Counter(r[0] for r in rows), Counter(r[1] for r in rows)
        print("launches through tests.helpers.launch: " + ", ".join(f"{k} {v}" for k, v in sorted(now.items())) +
              " (before warm launches: " + ", ".join(f"{k} {v}" for k, v in sorted(before.items())) + ")")
        timed = [r for r in rows if len(r) >= 4]
        if timed:  # where the launched tests' time goes: seconds per kind, and the files that launch the most
            seconds, files = Counter(), Counter()
            for r in timed:
                seconds[r[0]] += float(r[2])
                files[r[3].split("::")[0]] += float(r[2])
            print("seconds in launches: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.most_common()) +
                  "; most: " + ", ".join(f"{f} {v:.0f}" for f, v in files.most_common(8)))
        # warm launches that ran for real because their environment held a variable a fork cannot give: slower, and
        # the exit code is the real launcher's (a changed worker environment did this silently, 2026-12-07)
        unforked = [r for r in rows if len(r) >= 5 and r[4]]
        if unforked:
            names = sorted({name for r in unforked for name in r[4].split(",")})
            print(f"warm launches run for real for their environment: {len(unforked)} (variables {', '.join(names)};"
                  f" tests {', '.join(sorted({r[3] for r in unforked})[:5])})")
    print("ten slowest tests (setup + call + teardown, seconds on a worker that shares the cores):")
    for seconds, name in slowest([folder / "parallel.xml", folder / "serial.xml"]):
        print(f"  {seconds:7.1f}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".suite"))
