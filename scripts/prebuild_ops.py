"""Compile DeepSpeed's JIT ops once, into TORCH_EXTENSIONS_DIR, so runs do not wait for gcc/nvcc.

    python scripts/prebuild_ops.py CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder

Used by the Dockerfile. An op the accelerator does not offer (FusedAdam on CPU) is skipped with a line.
"""
import sys

from deepspeed.accelerator import get_accelerator

from dstrain.parallel.ds_internals import announce_jit_builds


def main(names: list[str]) -> None:
    accelerator = get_accelerator()
    announce_jit_builds(print)  # the same keyed build directories the runs load from
    for name in names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"skipping {name}: not available for {accelerator.device_name()}")
            continue
        builder.load(verbose=False)
        print(f"built {name} for {accelerator.device_name()}")


if __name__ == "__main__":
    main(sys.argv[1:])
