"""ZeRO-Infinity (ZeRO-3 with parameters and optimizer states offloaded to NVMe) against the plain loop, as every
ZeRO stage in tests/e2e/test_vs_reference.py. A file of its own because it is the one test that loads DeepSpeed's
AsyncIO op, which `make test` builds beside the tests at the lowest priority (Makefile, scripts/prebuild_ops.py
--beside): tests/conftest.py orders this file after the other launched files, and the test hurries what is left of
the build before its ranks start."""
import os
import subprocess
import sys

import pytest

from tests.e2e.test_vs_reference import assert_stage_run, run_and_compare
from tests.helpers import ROOT


@pytest.fixture
def async_io_op():
    """`make test`'s AsyncIO build beside the tests (its pid in DSTRAIN_TEST_OPS_BESIDE), at normal priority from
    here on and finished; nothing where the op was built ahead (make setup)."""
    pid = os.environ.get("DSTRAIN_TEST_OPS_BESIDE")
    if pid:
        said = subprocess.run([sys.executable, "scripts/prebuild_ops.py", "--hurry", pid], cwd=ROOT,
                              capture_output=True, text=True, timeout=1200, check=True).stdout
        print(said.strip())


def test_zero3_nvme_matches_reference(tmp_path, cache, tiny_llama, async_io_op):
    ds_config = "zero3_nvme.json"
    nvme = tmp_path / "nvme"  # parameters and optimizer states swapped through files here
    extra = [f"--ds.zero_optimization.offload_param.nvme_path={nvme}",
             f"--ds.zero_optimization.offload_optimizer.nvme_path={nvme}"]
    run_dir, ref_model = run_and_compare(tmp_path, cache, tiny_llama, ds_config, extra=extra)
    swap = nvme / "zero_stage_3"  # DeepSpeed deletes its swap files at exit but leaves the per-rank folders
    for kind in ("float32params", "optimizer"):
        assert {p.name for p in (swap / kind).iterdir()} == {"rank0", "rank1"}, kind
    assert_stage_run(run_dir, ref_model, ds_config)
