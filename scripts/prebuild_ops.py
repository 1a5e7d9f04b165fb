"""Compile DeepSpeed's JIT ops once, into TORCH_EXTENSIONS_DIR, so runs do not wait for gcc/nvcc.

    python scripts/prebuild_ops.py CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder

Used by the Dockerfile and `make setup`. An op the accelerator does not offer (FusedAdam on CPU) is skipped with a
line. One op after another: building the three CPU ops at once, one process each, took 312 s against 271 s in turn
on 2 cores (each build's ninja already runs a compiler per core).
"""
import sys
import time

from deepspeed.accelerator import get_accelerator

from dstrain.parallel.ds_internals import announce_jit_builds, remember_cpu_info


def main(names: list[str]) -> None:
    accelerator = get_accelerator()
    announce_jit_builds(print)  # the same keyed build directories the runs load from
    remember_cpu_info()  # the runs read the machine's answer instead of asking py-cpuinfo again
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"skipping {name}: not available for {accelerator.device_name()}")
            continue
        began = time.time()
        builder.load(verbose=False)
        print(f"built {name} for {accelerator.device_name()} in {time.time() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
