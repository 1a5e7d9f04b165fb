"""Compile DeepSpeed's JIT ops once, into TORCH_EXTENSIONS_DIR, so runs do not wait for gcc/nvcc.

    python scripts/prebuild_ops.py CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder
    python scripts/prebuild_ops.py --beside AsyncIOBuilder   # at the lowest priority, beside other work
    python scripts/prebuild_ops.py --hurry PID               # that build at normal priority again, waited for

Used by the Dockerfile and `make setup`. An op the accelerator does not offer (FusedAdam on CPU) is skipped with a
line. One op after another: building the three CPU ops at once, one process each, took 312 s against 271 s in turn
on 2 cores (each build's ninja already runs a compiler per core).

`make test` builds the AsyncIO op (NVMe offload, which one test loads) `--beside` the tests instead of ahead of them:
it takes the CPU only when the tests leave a core idle, and the test that needs it `--hurry`s it. Plain `nice` is not
enough: with the kernel's autogroup scheduling (sched_autogroup_enabled=1) the CPU is first shared between sessions,
and every launched test runs in a session of its own (a nice-19 AsyncIO build took 604 s beside the tests and a test
waited 436 s for it, 2026-12-07). So the build runs in a session of its own whose autogroup is set to nice 19, under
SCHED_IDLE: beside two busy processes it got 4% of a core (measured here). Lowering is allowed to anyone, raising
back only to root: elsewhere the build runs beside the tests at normal priority.
"""
import os
import sys
import time


def beside() -> None:
    """This process in a session of its own at the lowest priority (as root: see the module's docstring)."""
    try:
        os.setsid()
    except PermissionError:  # already a process group's leader (started by an interactive shell): its session
        return  # is the caller's, whose priority is not ours to lower
    if os.geteuid() != 0:
        return
    try:
        with open("/proc/self/autogroup", "w") as f:  # the session's share against other sessions
            f.write("19")
    except OSError:
        pass  # a kernel without autogroup: SCHED_IDLE alone orders it
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def hurry(pid: int) -> None:
    """Every process of `pid`'s session (the build, its ninja and compilers) back at normal priority; then wait
    until `pid` has exited."""
    import psutil

    began = time.time()
    for _ in range(2):  # a compiler forked while the first pass ran inherits its parent's old policy
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) != pid:
                    continue
                os.sched_setscheduler(proc.pid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, proc.pid, 0)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write("0")
    except OSError:
        pass
    try:  # not psutil's wait(): a build that has ended stays a zombie until its parent (make's shell) reaps it
        build = psutil.Process(pid)
        while build.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        pass
    print(f"waited {time.time() - began:.0f} s for the op build beside (pid {pid})", flush=True)


def main(names: list[str]) -> None:
    if names[:1] == ["--hurry"]:
        hurry(int(names[1]))
        return
    if names[:1] == ["--beside"]:
        beside()
        names = names[1:]
    from deepspeed.accelerator import get_accelerator

    from dstrain.parallel.ds_internals import announce_jit_builds, remember_cpu_info

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
