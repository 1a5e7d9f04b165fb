"""scripts/prebuild_ops.py's --beside and --hurry, which `make test` uses to build DeepSpeed's AsyncIO op beside the
parallel part at the lowest priority and to finish it at normal priority when the NVMe test needs it (Makefile)."""
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

# a stand-in for the build: lowered as `--beside` lowers it, it says how it runs and leaves once it runs at normal
# priority again (or after 60 s)
CHILD = """
import os, runpy, sys, time
runpy.run_path("scripts/prebuild_ops.py")["beside"]()
group = open("/proc/self/autogroup").read().split()[-1] if os.path.exists("/proc/self/autogroup") else "-"
print(os.getsid(0) == os.getpid(), os.sched_getscheduler(0) == os.SCHED_IDLE, group, flush=True)
end = time.time() + 60
while os.sched_getscheduler(0) == os.SCHED_IDLE and time.time() < end:
    time.sleep(0.05)
print("hurried" if time.time() < end else "never hurried", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority back needs root; elsewhere --beside lowers none")
def test_a_build_beside_runs_in_its_own_session_at_idle_priority_until_hurried():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        own_session, idle, group = child.stdout.readline().split()
        assert own_session == "True" and idle == "True"
        if os.path.exists("/proc/self/autogroup"):  # its session's share against the tests' sessions
            assert group == "19"
        began = time.time()
        hurry = subprocess.run([sys.executable, "scripts/prebuild_ops.py", "--hurry", str(child.pid)], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert hurry.returncode == 0, hurry.stderr
        assert child.stdout.readline().strip() == "hurried"
        assert time.time() - began < 30 and child.wait(timeout=10) == 0  # --hurry returned once the build was done
        assert f"for the op build beside (pid {child.pid})" in hurry.stdout
    finally:
        child.kill()
        child.wait()
