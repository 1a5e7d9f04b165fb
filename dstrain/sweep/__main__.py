"""python -m dstrain.sweep SWEEP.yaml [--report] [--key=value ...]: run (or continue) a sweep; docs/sweeps.md."""
from __future__ import annotations

import argparse
import sys

from ..cli import exit_with
from ..errors import EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dstrain.sweep", allow_abbrev=False,
                                     description="Run a hyper-parameter sweep: each trial is a train.py run directory; "
                                                 "started again, it continues the study.",
                                     epilog="Any key of the sweep file can be overridden: --parallel=2 "
                                            "--trials=20 --output_dir=runs/sweeps/x")
    parser.add_argument("sweep", help="sweep YAML in sweeps/ or a path")
    parser.add_argument("--report", action="store_true", help="print the table of the study so far and exit")
    parser.add_argument("--check", action="store_true", help="check the sweep file and exit")
    args, rest = parser.parse_known_args(argv)
    from . import report
    from .spec import load
    from .study import Worker, check_devices, devices, open_study

    sweep = load(args.sweep, rest)
    if args.check:
        print(f"{sweep.path}: {len(sweep.space)} keys, {sweep.trials} trials, {sweep.sampler} sampler, "
              f"{sweep.pruner.type} pruner, metric {sweep.metric} ({sweep.direction})")
        return EXIT_OK
    gpus = devices()
    check_devices(sweep, gpus)
    study = open_study(sweep)
    if args.report:
        print(report.write(sweep, study))
        return EXIT_OK
    try:
        return Worker(sweep, study, gpus).run()
    finally:  # the table also when a trial's input was refused (the one line follows it)
        print(report.write(sweep, study), flush=True)


if __name__ == "__main__":
    exit_with(lambda: main(sys.argv[1:]))
