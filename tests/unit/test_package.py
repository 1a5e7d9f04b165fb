"""The package's hygiene, checked so it stays true: no sys.path games, train.py imported by nothing, every
environment variable read in dstrain/env.py (documented: tests/unit/test_docs.py), exit codes defined once."""
import re
from pathlib import Path

import pytest

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
    assert (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USER_ERROR, errors.EXIT_NONFINITE, errors.EXIT_SAVE_FAILED,
            errors.EXIT_STOPPED, errors.EXIT_INTERRUPTED) == (0, 1, 2, 65, 74, 75, 130)
    literal = re.compile(r"(sys\.exit|_exit|return)\((1|2|65|74|75)\)|EXIT_CODE = (1|2|65|74|75)\b|= (65|74|75)\s*#")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE + [ROOT / "train.py"]
                 for i, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
    assert offenders == []
    launch = (ROOT / "launch/common.sh").read_text()  # the shell side agrees on which codes are final
    assert "0|2|65|74|75|130)" in launch


def _imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The dstrain modules `module` imports anywhere in its file (function-level imports too), with the package
    __init__ of each (importing a.b.c runs a.b first); a submodule's import of its own package is not counted."""
    import ast
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            for alias in node.names:
                found.add(f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else name)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    with_packages = set()
    for name in found & modules:
        parts = name.split(".")
        with_packages.update(".".join(parts[:k]) for k in range(2, len(parts) + 1))
    return {m for m in with_packages & modules if m != module and not module.startswith(m + ".")}


def test_no_import_cycles():
    """Issue 30: config <-> chat_templates, checkpoint -> resume -> export -> checkpoint and metrics <-> planner
    were circles; lazy imports count (they only hide a circle until a refactor moves one)."""
    files = {}
    for path in (ROOT / "dstrain").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _imports_of(m, p, set(files)) for m, p in files.items()}

    def reaches(start: str, target: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == target:
                    return trail + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = {" -> ".join(c) for m in graph if (c := reaches(m, m))}
    assert cycles == set()


def test_run_does_not_import_the_loop():
    """Issue 70: the loop (dstrain/trainer/) uses run/ (checkpoints, checks, faults); run/ never the loop, nor its
    private names, so a check or a checkpoint module is read and tested without it."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "dstrain/run").rglob("*.py")}
    everything = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "dstrain").rglob("*.py")}
    offenders = {m: sorted(i for i in _imports_of(m.removesuffix(".__init__"), p, everything)
                           if i.startswith("dstrain.trainer"))
                 for m, p in files.items()}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_train_py_reads_in_one_screen_and_no_module_is_too_long():
    """Issue 70: train.py's longest function is at most 60 lines (the phases live in dstrain/trainer/), no module of
    the package is over 700 lines."""
    import ast
    tree = ast.parse((ROOT / "train.py").read_text())
    longest = max((node.end_lineno - node.lineno + 1, node.name) for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef))
    assert longest[0] <= 60, longest
    long_modules = {str(p.relative_to(ROOT)): n for p in PACKAGE if (n := len(p.read_text().splitlines())) > 700}
    assert long_modules == {}


def test_every_import_of_ours_resolves():
    """Every `from dstrain... import name` (function-level ones too) names a module or attribute that exists:
    dstrain is a namespace package, so ruff cannot see a name left behind by a move (issue 70's
    `from dstrain import memory` in train.py's preflight, after memory.py moved to planner/)."""
    import ast
    import importlib
    bad = []
    for path in PACKAGE + [ROOT / "train.py"]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = ".".join(parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("dstrain")):
                continue
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + [node.module]) if node.level and node.module else \
                ".".join(base) if node.level else node.module
            found = importlib.import_module(module)
            for alias in node.names:
                if not hasattr(found, alias.name) and importlib.util.find_spec(f"{module}.{alias.name}") is None:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {module}.{alias.name}")
    assert bad == []


def test_make_setup_byte_compiled_the_installed_packages():
    """`make setup` installs with pip's --no-compile and byte-compiles afterwards on every core (compileall -j 0).
    Without the .pyc files, where PYTHONDONTWRITEBYTECODE is set (this machine and CI) every launch compiles its
    imports again: the suite took ~10 minutes longer (issue 83). Modules no test imports, so no run wrote them."""
    import importlib.util
    import sysconfig

    site = Path(sysconfig.get_path("purelib"))
    if not (site / "torch").is_dir() or not str(site).startswith(str(ROOT)):
        pytest.skip("not the project's own .venv")
    for source in ("torch/_inductor/codegen/rocm/rocm_kernel.py", "transformers/models/bert/modeling_bert.py",
                   "deepspeed/inference/v2/engine_v2.py", "datasets/packaged_modules/xml/xml.py"):
        assert Path(importlib.util.cache_from_source(str(site / source))).exists(), f"{source} has no .pyc"
