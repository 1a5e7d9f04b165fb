"""The package's hygiene, checked so it stays true: no sys.path games, train.py imported by nothing, every
environment variable read in dstrain/env.py (documented: tests/unit/test_docs.py), exit codes defined once."""
import re
from pathlib import Path

from dstrain import errors

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and ".git" not in p.parts]
PACKAGE = sorted((ROOT / "dstrain").rglob("*.py"))


def test_no_sys_path_insert_anywhere():
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert offenders == []


def test_nothing_in_the_package_imports_train_py():
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE if re.search(r"^\s*(import train|from train import)\b",
                                                                         p.read_text(), re.M)]
    assert offenders == []


def test_environment_is_read_in_env_py_only():
    reads = re.compile(r"os\.environ(\.get\(|\[)|os\.getenv\(")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE + [ROOT / "train.py"] if p.name != "env.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert offenders == []


def test_exit_codes_are_defined_once():
    assert (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USER_ERROR, errors.EXIT_SAVE_FAILED,
            errors.EXIT_STOPPED, errors.EXIT_INTERRUPTED) == (0, 1, 2, 74, 75, 130)
    literal = re.compile(r"(sys\.exit|_exit|return)\((1|2|74|75)\)|EXIT_CODE = (1|2|74|75)\b|= (74|75)\s*#")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE + [ROOT / "train.py"]
                 for i, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
    assert offenders == []
    launch = (ROOT / "launch/common.sh").read_text()  # the shell side agrees on which codes are final
    assert "0|2|74|75|130)" in launch
