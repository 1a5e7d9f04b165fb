"""torchvision for the tests of the vision-language families whose processors need it (Qwen2-VL, Qwen2.5-VL, SmolVLM:
transformers builds their image and video processors on torchvision's transforms), beside the venv, not in it.

    python scripts/torchvision_side.py DIR     # tests/conftest.py puts DIR on the path of the suite's processes

`make test` and `make test-fast` run it (DIR/.done once it has).

Where the venv's torch already has its torchvision, nothing is done. Otherwise the torchvision release made for this
torch (0.N+15 for torch 2.N) goes into DIR with pip --target, without its dependencies: on a CPU-only torch the one
wheel a registry holds may be a CUDA build, whose compiled detection ops (nms, roi_align: no processor calls them)
cannot load. torchvision then still registers fake kernels for two of them and fails at import ("operator
torchvision::nms does not exist"), so DIR also gets a sitecustomize that declares those two operators when
torchvision is first imported by a torch without CUDA. The transforms the processors use are torchvision's Python
over torch's own operators. Written by hand: no package offers a torchvision for a torch it was not built with.
A user's machine installs the matching torchvision (`pip install torchvision`); the run says so when it is missing.
"""
import subprocess
import sys
from pathlib import Path

SHIM = '''"""Declares torchvision's nms and qnms on a torch without CUDA before torchvision registers fake kernels
for them (scripts/torchvision_side.py): its CUDA-built C++ ops cannot load there, and its import would fail."""
import importlib.abc
import sys

_kept = []


class _DeclareOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch
        # once per process, however many copies of this file were loaded (the interpreter's sitecustomize from
        # PYTHONPATH and tests/torchvision_side.py's, which loads it by its path)
        if torch.version.cuda is None and not hasattr(torch.ops.torchvision, "nms"):
            library = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                library.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _kept.append(library)
        return None  # found by the usual finders


sys.meta_path.insert(0, _DeclareOps())
'''

CHECK = ("import torch, torchvision; from torchvision.transforms.v2 import functional as F; "
         "assert F.resize(torch.rand(3, 8, 8), [4, 4]).shape == (3, 4, 4); print(torchvision.__version__)")


def main(folder: str) -> int:
    side = Path(folder)
    side.mkdir(parents=True, exist_ok=True)
    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0:
        (side / ".done").write_text("the venv's own torchvision\n")
        return 0
    import torch
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    wanted = f"torchvision=={major - 2}.{minor + 15}.*"
    if not (side / "torchvision").exists():
        got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                              str(side), wanted], capture_output=True, text=True)
        if got.returncode:
            print(f"note: {wanted} not installed ({got.stderr.strip()[-200:]}); the vision tests of Qwen2-VL, "
                  f"Qwen2.5-VL and SmolVLM need it", file=sys.stderr)
            return 1
    (side / "sitecustomize.py").write_text(SHIM)
    # byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set, every import would compile it again
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(side)], capture_output=True)
    env = {"PYTHONPATH": str(side.resolve()), "PATH": "/usr/bin:/bin"}
    got = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env)
    if got.returncode:
        print(f"note: torchvision in {side} does not import: {got.stderr.strip()[-300:]}", file=sys.stderr)
        return 1
    print(f"torchvision {got.stdout.strip()} for torch {torch.__version__} in {side}")
    (side / ".done").write_text(got.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
