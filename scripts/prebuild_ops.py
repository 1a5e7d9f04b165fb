"""Compile DeepSpeed's JIT ops once, into TORCH_EXTENSIONS_DIR, so runs do not wait for gcc/nvcc.

    python scripts/prebuild_ops.py CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder

Used by the Makefile and the Dockerfile. An op the accelerator does not offer (FusedAdam on CPU) is skipped with a
line. Several ops build side by side, one process each, as many at a time as there are cores: one op's build kept
one core busy (8 min of CPU time for the three CPU ops in 8 min of wall time on 2 cores), which `make test` waited
for before any test.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def build(name: str) -> None:
    from deepspeed.accelerator import get_accelerator

    from dstrain.ds_internals import announce_jit_builds  # the Dockerfile, which installs no dstrain, sets PYTHONPATH

    accelerator = get_accelerator()
    announce_jit_builds(print)  # the same keyed build directories the runs load from
    builder = accelerator.create_op_builder(name)
    if builder is None or not builder.is_compatible(verbose=False):
        print(f"skipping {name}: not available for {accelerator.device_name()}")
        return
    builder.load(verbose=False)
    print(f"built {name} for {accelerator.device_name()}")


def main(names: list[str]) -> int:
    if len(names) == 1:
        build(names[0])
        return 0

    def one(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, __file__, name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)

    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        done = list(pool.map(one, names))
    for name, proc in zip(names, done):
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            print(f"building {name} failed (exit {proc.returncode})", file=sys.stderr)
    return max((proc.returncode for proc in done), default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
