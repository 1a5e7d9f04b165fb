"""Every causal-LM family of the installed transformers under the layouts that cut sequences: the checks train.py
runs before such a run (dstrain/families.py), on each family's default config made small, in one process on CPU.

    python scripts/family_matrix.py            # prints the table
    python scripts/family_matrix.py --write    # and writes docs/family_matrix.json and docs/models.md's table

A family whose default config does not show its layer kinds gets the overrides of families.REPRESENTATIVE (its
released models' pattern). Each family has SECONDS to build and run; one that cannot be built small is listed as such.
tests/unit/test_families.py checks the written matrix against the installed transformers and rechecks the families
issue 85 named (`make test-family-matrix`: all of them).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SECONDS = 60
BEGIN, END = "<!-- family matrix: scripts/family_matrix.py writes between these lines -->", "<!-- end of the matrix -->"


class _Late(Exception):
    pass


def _alarm(*_):
    raise _Late(f"over {SECONDS} s")


def verdict(name: str) -> dict:
    """families.verdict within SECONDS."""
    from dstrain import families
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS)
    try:
        return families.verdict(name)
    finally:
        signal.alarm(0)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*", help="only these (default: every causal-LM family)")
    parser.add_argument("--write", action="store_true", help="write docs/family_matrix.json and docs/models.md")
    args = parser.parse_args()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as tlog

    from dstrain import families
    tlog.set_verbosity_error()
    names = args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = []
    for name in names:
        rows.append(verdict(name))
        r = rows[-1]
        said = f"not built: {r['why']} ({r['where']})" if not r["built"] else " | ".join(
            f"{k} {'ok' if r[k]['holds'] else 'REFUSED ' + str(r[k]['culprit'])} ({r[k]['difference']})"
            for k in families.CHECKS)
        print(f"{name:28s} {r['seconds']:5.1f}s {said}", flush=True)
    built = [r for r in rows if r["built"]]
    both = [r for r in built if r["packing"]["holds"] and r["sequence split"]["holds"]]
    others = "; ".join(f"{k}: {sum(r[k]['holds'] for r in built)} verified, {sum(not r[k]['holds'] for r in built)} "
                       f"refused" for k in ("chunked loss", "activation checkpointing", "pipeline"))
    print(f"{len(rows)} families: {len(built)} built small, {len(both)} verified under both layouts, "
          f"{len(built) - len(both)} refused at least one; {others}; transformers {transformers.__version__}")
    if args.write:
        (ROOT / "docs/family_matrix.json").write_text(json.dumps(
            {"transformers": transformers.__version__, "rows": rows}, indent=1) + "\n")
        page = ROOT / "docs/models.md"
        text = page.read_text()
        head, rest = text.split(BEGIN)
        _, tail = rest.split(END)
        summary = (f"{len(rows)} causal-LM families in transformers {transformers.__version__}: {len(built)} built "
                   f"small, {len(both)} verified under packing and a sequence split, {len(built) - len(both)} refused "
                   f"at least one, {len(rows) - len(built)} not built small (checked on the run's own config at its "
                   f"first run). Of the {len(built)} built: {others} (default configs: a checkpoint whose config "
                   f"scales its logits, e.g. Granite's logits_scaling, is refused the chunked loss at its run).")
        page.write_text(head + BEGIN + "\n" + summary + "\n\n" + families.table(rows) + "\n" + END + tail)


if __name__ == "__main__":
    main()
