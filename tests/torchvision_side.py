"""torchvision beside the venv (scripts/torchvision_side.py, where the venv's torch has none) for the processors of
Qwen2.5-VL and SmolVLM: on the path of the test process and of tests/warm.py's forkserver, with the two operators
its side folder's sitecustomize declares; not on PYTHONPATH for every process the tests start: there each
interpreter ran its own copy of the shim beside conftest's (stop 97's CI failure), and each paid torchvision's
import (0.1-0.2 CPU-s per `python train.py` of the tiny recipe, measured 2026-12-07). Plain Python (no pytest): the forkserver imports it."""
import importlib.util
import site
import sys
from pathlib import Path

SIDE = Path(sys.prefix) / "share" / "torchvision"
SHIM = "dstrain_torchvision_shim"


def activate() -> None:
    """The side folder on sys.path and its operators declared, once per process; nothing where the venv has its own
    torchvision or the folder was not made."""
    if SHIM in sys.modules or not (SIDE / "sitecustomize.py").exists():
        return
    found = importlib.util.find_spec("torchvision")  # the side's where this process's sys.path came from one that
    if found is not None and not str(found.origin).startswith(str(SIDE)):  # has it (the forkserver's); else the
        return  # venv's own, or one on a PYTHONPATH the user set
    site.addsitedir(str(SIDE))  # the folder is a site directory of its own
    # kept in sys.modules as an interpreter keeps its sitecustomize: the operators it declares live as long as its
    # torch.library.Library does
    spec = importlib.util.spec_from_file_location(SHIM, SIDE / "sitecustomize.py")
    sys.modules[SHIM] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[SHIM])
