"""The Dockerfile, built for real with podman on a local Debian base (no registry is reachable here):
its `test` stage installs the project, prebuilds DeepSpeed's ops and trains the default recipe to its
end inside the build (scripts/image_smoke_test.py checks steps, falling loss and the export)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.cluster.conftest import need
from tests.helpers import ROOT

BASE = "localhost/dstrain-test-base:bookworm"
IMAGE = "localhost/dstrain-test:latest"
STEPS = 40


def pip_settings() -> tuple[list[str], list[str]]:
    """This machine's pip mirror settings as build args, and the host folders they name as read-only mounts."""
    out = subprocess.run(["pip", "config", "list"], capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        values[key.split(".")[-1]] = value.strip().strip("'")
    args, mounts = [], []
    for key, arg in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                     ("find-links", "PIP_FIND_LINKS")):
        if values.get(key):
            args += ["--build-arg", f"{arg}={values[key]}"]
            for location in values[key].split():
                path = Path(location.removeprefix("file://"))
                if path.is_absolute() and path.exists():
                    top = Path("/", *path.parts[1:3])  # /opt/pypi for /opt/pypi/simple
                    mounts.append(f"{top}:{top}:ro")
    if values.get("cert") and Path(values["cert"]).exists():  # a proxy's CA, which the base image lacks
        args += ["--build-arg", "PIP_CERT=/etc/ssl/certs/host-pip-ca.crt"]
        mounts.append(f"{values['cert']}:/etc/ssl/certs/host-pip-ca.crt:ro")
    return args, [item for mount in dict.fromkeys(mounts) for item in ("-v", mount)]


def local_base(tmp_path: Path) -> None:
    """A minimal Debian bookworm image made with debootstrap (about 30 s), imported once per machine."""
    if subprocess.run(["podman", "image", "exists", BASE]).returncode == 0:
        return
    root = tmp_path / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian"],
                   check=True, capture_output=True, timeout=600)
    for conf in Path("/etc/apt/apt.conf.d").glob("99*"):  # this machine's apt mirror quirks, if any
        shutil.copy(conf, root / "etc/apt/apt.conf.d" / conf.name)
    tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", BASE], stdin=tar.stdout, check=True, capture_output=True)
    tar.wait()


def test_image_builds_and_trains_the_default_recipe(tmp_path):
    need("podman", "debootstrap")
    local_base(tmp_path)
    args, mounts = pip_settings()
    # One op is enough to show that ops are compiled into the image (the default also builds CPUAdam, AsyncIO and
    # FusedAdam: minutes more of the suite on 2 cores, the same mechanism). The CPU ranks' shared-memory
    # collectives op is the one the smoke run loads, so the build also shows the run found it (no JIT build);
    # it compiles in 30 s here against CPUAdam's 47 s.
    # 40 of the recipe's 150 steps: the eval loss has halved by then (6.4 -> 2.1 measured at step 40), and the
    # whole recipe's run is test_default_recipe's; a minute less of the suite
    # --layers=false: the stages committed once each instead of a layer per step (the pip step's 1.5 GB layer alone
    # took ~50 s to commit); NO_COMPILE: no .pyc for the thousands of modules the smoke run never imports (pip's
    # byte-compiling was half of installing torch and transformers: 44 s against 20 measured here)
    cmd = ["podman", "build", "--isolation", "chroot", "--layers=false", "--target", "test",
           "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", "NO_COMPILE=1",
           "--build-arg", "DS_PREBUILD_OPS=ShareMemCommBuilder", "--build-arg", f"SMOKE_ARGS=--train.max_steps={STEPS}",
           *args, *mounts, "-t", IMAGE, str(ROOT)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    finally:
        subprocess.run(["podman", "rmi", "-f", IMAGE], capture_output=True)
        subprocess.run(["podman", "image", "prune", "-f"], capture_output=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "built ShareMemCommBuilder for cpu" in out, out[-8000:]  # the op is in the image
    assert "building DeepSpeed's" not in out.split("built ShareMemCommBuilder")[1], out[-8000:]  # not JIT at start
    assert f"image smoke test: {STEPS} steps" in out, out[-8000:]
