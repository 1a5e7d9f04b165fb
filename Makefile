# Two commands on a fresh machine: `make train` and `make test`. Everything else is optional.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# every local device: the GPUs, or 2 CPU ranks on a machine without one
NUM_RANKS ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)
# CPU ranks share the cores; without this each rank would start one thread per core
export OMP_NUM_THREADS ?= $(shell n=$$(( $$(nproc) / $(NUM_RANKS) )); [ $$n -gt 0 ] && echo $$n || echo 1)
export TOKENIZERS_PARALLELISM ?= false
RECIPE ?= recipes/tiny/pretrain.yaml
DS_CONFIG ?=
ARGS ?=
PYTEST_ARGS ?=
# launched tests are 2-rank jobs that wait on imports and collectives as much as they compute: two at once fill
# the 2 cores better than one (measured: see docs/testing.md)
TEST_WORKERS ?= 2

.PHONY: family-tensor-parallel docs docs-serve setup system-deps test-deps packages prebuild-ops train test test-moe-matrix test-family-matrix test-fast bench bench-launches bench-profile bench-loss-gap bench-checkpoints bench-gpu bench-memory bench-loss bench-compression bench-slow-links bench-lora bench-dpo bench-grpo bench-vlm bench-planner bench-long-context bench-prepare-data lint assets clean

setup: system-deps $(VENV)/.installed $(VENV)/.ops-built

# Debian packages DeepSpeed's JIT-built ops need: libaio for NVMe offload (the async_io op).
# Installed when missing and we are root with apt-get; otherwise a hint, since only NVMe offload needs it.
SYSTEM_PACKAGES ?= libaio-dev
# The tests also start real cluster programs (tests/cluster): sshd + pdsh, a SLURM cluster, podman.
# Without them (no root, no apt) those tests skip and say why.
TEST_PACKAGES ?= openssh-server openssh-client pdsh slurmctld slurmd slurm-client munge podman debootstrap shellcheck
define apt_install
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing" $$missing; \
	    (apt-get install -y -qq $$missing >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq $$missing)) >/dev/null; \
	  else echo "note: install" $$missing "(e.g. sudo apt-get install" $$missing")"; fi; fi
endef
system-deps:
	$(call apt_install,$(SYSTEM_PACKAGES))

test-deps:
	$(call apt_install,$(TEST_PACKAGES))

# A system python that already has torch (a CUDA image) lends it to the venv instead of a reinstall.
$(VENV)/.installed: requirements.txt pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if python3 -c "import torch" 2>/dev/null; then python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; fi
	@# every module byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set (this machine and CI) no process
	@# may write a .pyc later, and every launch compiled its imports again (the suite ~10 minutes slower, issue 83).
	@# pip compiles file by file on one core (half of installing torch and transformers: 44 s against 20);
	@# compileall after it uses every core, with the same .pyc files
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
	@$(PY) -c "import torch, deepspeed, transformers; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__)" 2>/dev/null
	@touch $@

train: setup
	$(VENV)/bin/deepspeed --num_gpus $(NUM_RANKS) train.py --recipe $(RECIPE) $(if $(DS_CONFIG),--ds_config $(DS_CONFIG)) $(ARGS)

# DeepSpeed's JIT-built ops (CPU shared-memory collectives, CPU Adam for offload, async I/O for NVMe): built
# once by `make setup`, so no first run sits silent for minutes of gcc (a run that does build one says so).
PREBUILD_OPS ?= ShareMemCommBuilder CPUAdamBuilder AsyncIOBuilder
$(VENV)/.ops-built: $(VENV)/.installed scripts/prebuild_ops.py
	@echo "building DeepSpeed's ops ($(PREBUILD_OPS)) once: a few minutes on a fresh machine"
	@$(PY) scripts/prebuild_ops.py $(PREBUILD_OPS) > $(VENV)/prebuild_ops.log 2>&1 || \
	  { tail -20 $(VENV)/prebuild_ops.log; exit 1; }
	@touch $@
prebuild-ops: system-deps $(VENV)/.ops-built

# `make test` builds ahead the ops its early tests load (every CPU rank loads the shared-memory collectives; offload
# tests CPUAdam) and AsyncIO (NVMe offload: one test, tests/e2e/test_nvme_offload.py, ordered late) beside the
# parallel part at the lowest priority (scripts/prebuild_ops.py --beside), in the moments its workers leave a core
# idle, instead of 2-3 minutes ahead of it; the NVMe test hurries what is left of it
PREBUILD_LATER ?= AsyncIOBuilder
PREBUILD_FIRST = $(filter-out $(PREBUILD_LATER),$(PREBUILD_OPS))
$(VENV)/.ops-first: $(VENV)/.installed scripts/prebuild_ops.py
	@$(MAKE) --no-print-directory -q $(VENV)/.ops-built 2>/dev/null || { \
	  echo "building DeepSpeed's ops ($(PREBUILD_FIRST)) now, $(PREBUILD_LATER) beside the tests"; \
	  $(PY) scripts/prebuild_ops.py $(PREBUILD_FIRST) > $(VENV)/prebuild_ops.log 2>&1 || \
	  { tail -20 $(VENV)/prebuild_ops.log; exit 1; }; }
	@touch $@

# every Debian package in one apt call (one dpkg lock), beside pip's install; the ops are built after both (the
# AsyncIO op needs libaio) with the machine to themselves
packages:
	$(call apt_install,$(SYSTEM_PACKAGES) $(TEST_PACKAGES))

# OpenAI's o200k vocabulary for the test of gpt-oss's format against openai-harmony (tests/unit/test_chat_data.py):
# harmony downloads it from OpenAI's blob store, which a machine with only a package registry cannot reach
HARMONY_VOCAB := $(VENV)/share/tiktoken/o200k_base.tiktoken
$(HARMONY_VOCAB): | $(VENV)/.installed
	-@$(PY) scripts/harmony_vocab.py $(dir $@)
# torchvision for the tests of Qwen2.5-VL and SmolVLM (their processors need it), beside the venv where its torch
# has none (scripts/torchvision_side.py says how and why)
TORCHVISION_SIDE := $(VENV)/share/torchvision/.done
$(TORCHVISION_SIDE): scripts/torchvision_side.py | $(VENV)/.installed
	-@$(PY) scripts/torchvision_side.py $(dir $@)

# the files that hold `serial` tests (marked with pytest.mark.serial in the file itself): the serial part collects
# only these, not all 1,288 tests again (7-11 s alone on 2 cores, all of it on the serial part's clock)
SERIAL_FILES = $(or $(shell grep -rl --include='test_*.py' 'pytest.mark.serial' tests 2>/dev/null | sort),tests)
# lint first: a style slip fails in seconds, not after the suite (pyproject.toml prints the 20 slowest tests)
# at its end: the wall time of each part, the ten slowest tests and this machine's speed (scripts/suite_report.py)
test:
	@rm -rf .suite && mkdir -p .suite && date +%s.%N > .suite/started.at
	@$(MAKE) --no-print-directory -j2 packages $(VENV)/.installed
	@# lint, then the docs build, beside the ops' compile (lint and docs keep one core busy where they ran alone)
	@$(MAKE) --no-print-directory -j2 system-deps $(VENV)/.ops-first lint docs $(HARMONY_VOCAB) $(TORCHVISION_SIDE)
	@# two workers, one test file each at a time (module fixtures share launched runs), then the `serial` tests
	@# (timings, a deliberately busy machine) alone, once the ops built beside have finished; both parts run and
	@# report before the target fails
	@date +%s.%N > .suite/parallel.at; rc=0; export DSTRAIN_TEST_LAUNCH_LOG=$(CURDIR)/.suite/launches.log; \
	if ! $(MAKE) --no-print-directory -q $(VENV)/.ops-built 2>/dev/null; then \
	  $(PY) scripts/prebuild_ops.py --beside $(PREBUILD_LATER) > .suite/ops.log 2>&1 & \
	  export DSTRAIN_TEST_OPS_BESIDE=$$!; fi; \
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --junitxml=.suite/parallel.xml $(PYTEST_ARGS) || rc=$$?; \
	if [ -n "$${DSTRAIN_TEST_OPS_BESIDE:-}" ]; then $(PY) scripts/prebuild_ops.py --hurry $$DSTRAIN_TEST_OPS_BESIDE >/dev/null; \
	  if wait $$DSTRAIN_TEST_OPS_BESIDE; then touch $(VENV)/.ops-built; sed -n 's/^built/beside the parallel part: built/p' .suite/ops.log; \
	  else echo "DeepSpeed's ops did not build beside the tests:"; tail -20 .suite/ops.log; rc=1; fi; fi; \
	date +%s.%N > .suite/serial.at; \
	$(PY) -m pytest $(SERIAL_FILES) -q -m serial --junitxml=.suite/serial.xml $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	date +%s.%N > .suite/ended.at; $(PY) scripts/suite_report.py .suite || true; exit $$rc

# every MoE family x ZeRO stage x activation checkpointing under expert parallelism (tests/e2e/test_moe.py runs a
# covering seven of them in `make test`; this adds the other 26 of the 33, about 6 minutes on 2 cores)
test-moe-matrix: setup
	DSTRAIN_TEST_MOE_MATRIX=1 $(PY) -m pytest tests/e2e/test_moe.py -q -s -p no:xdist -k expert_parallel_2 $(PYTEST_ARGS)

# every causal-LM family of the installed transformers rechecked against docs/family_matrix.json (about 2 minutes;
# `make test` rechecks the families issue 85 named)
test-family-matrix: setup
	DSTRAIN_TEST_FAMILY_MATRIX=1 $(PY) -m pytest tests/unit/test_families.py -q -k every_family $(PYTEST_ARGS)

# AutoTP on 2 gloo ranks for every family the matrix builds: the verdicts train.py reads before a tensor-parallel run
# (dstrain/components/tensor_parallel_families.json) and docs/models.md's table (about 20 minutes on 2 cores)
family-tensor-parallel: setup
	$(PY) scripts/family_tensor_parallel.py --all --write

test-fast: setup lint $(HARMONY_VOCAB) $(TORCHVISION_SIDE)
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

# the documentation site (mkdocs.yml): reference pages regenerated from the code, then built with --strict
docs: $(VENV)/.installed
	$(PY) scripts/gen_reference_docs.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

docs-serve: docs
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

# side-by-side measurements, printed and written to docs/benchmarks.md (BENCH_ARGS="--preset large" for a bigger job)
BENCH_ARGS ?=
bench: setup
	$(PY) bench/speed.py --write $(BENCH_ARGS)

# where train.py's step time goes against the plain loop's (torch.profiler traces of the same steps, side by side)
bench-profile: setup
	$(PY) bench/profile_steps.py $(BENCH_ARGS)

# where a launched test's time goes: the deepspeed runner, torchrun and warm ranks on one short job (a few minutes)
bench-launches: setup
	PYTHONPATH=$(CURDIR) $(PY) bench/launches.py --write $(BENCH_ARGS)

# the final-loss gap to the Trainer, its four settings aligned with train.py's one at a time
bench-loss-gap: setup
	$(PY) bench/loss_gap.py --results docs/loss_gap_bench.json --write $(BENCH_ARGS)

# on a CUDA machine: tests/gpu (QLoRA; bf16 and fp16 against the fp32 loop), the gpu-1b speed bench against the
# Trainer and ZeRO++ (scripts/gpu_checks.sh; logs in /tmp/dstrain-gpu-checks)
bench-gpu: setup test-deps
	PY=$(PY) bash scripts/gpu_checks.sh

bench-memory: setup
	$(PY) bench/memory.py --write $(BENCH_ARGS)

# train.loss_chunk_tokens on a 128k vocabulary: peak memory, tokens/s, losses (about 20 min on 2 cores)
bench-loss: setup
	$(PY) bench/loss_chunks.py --repeats 3 --write $(BENCH_ARGS)

# gradient compression: bytes, convergence over 3 data orders, and step time on a tc-limited veth link (needs
# root for that part); about 85 min on 2 cores
bench-lora: setup
	$(PY) bench/lora.py --write $(BENCH_ARGS)

# DPO through train.py and through TRL's DPOTrainer (its quick start, and with precompute_ref_log_probs)
bench-dpo: setup
	$(PY) bench/dpo.py --write $(BENCH_ARGS)

# GRPO through train.py and through TRL's GRPOTrainer on make train's export (prompts/s, memory)
bench-grpo: setup
	$(PY) bench/grpo.py --write $(BENCH_ARGS)

# vision-language SFT (the tiny recipe's job) through train.py and through TRL's SFTTrainer (rows/s, memory; ~6 min)
bench-vlm: setup
	$(PY) bench/vlm.py --write $(BENCH_ARGS)

# the planner's predictions against trials on a 100 Mbit/s and an unshaped veth link between two network namespaces
# (root, iproute2; about 20 min on 2 cores), and against published Megatron-LM runs
bench-planner: setup
	$(call apt_install,iproute2)
	$(PY) bench/planner.py --write $(BENCH_ARGS)

# Ulysses sequence parallelism: longest sequence within a per-rank budget at sp=1 and sp=2; packing's padding and
# tokens/s on the SFT recipe (about 15 min on 2 cores)
bench-long-context: setup
	$(PY) bench/long_context.py --lengths 4096 8192 16384 32768 --budget_mib 120 --results docs/long_context_bench.json --write $(BENCH_ARGS)

# prepare_data on a generated 2 GiB corpus (1 vs 2 workers), then start-up and RSS per rank on it vs the tiny corpus
bench-prepare-data: setup
	$(PY) bench/prepare_data.py $(BENCH_ARGS)

# checkpoint stall and tokens/s: synchronous against background saves, ZeRO-2 and ZeRO-3 on the ~100M bench model
# (about 10 min on 2 cores with these settings)
bench-checkpoints: setup
	$(PY) bench/checkpoints.py --steps 16 --every 5 --skip 3 --write $(BENCH_ARGS)

bench-compression: setup
	$(call apt_install,iproute2)
	$(PY) bench/compression.py --seeds 42,1,2 --slow-link --write $(BENCH_ARGS)

# time to a target loss across a 100 Mbit/s link: DiLoCo, PowerSGD and the synchronous run (root, iproute2; about
# 35 min on 2 cores, and 40 more for the other data orders' losses), then the same on a corpus seen once (35 min)
bench-slow-links: setup
	$(call apt_install,iproute2)
	$(PY) bench/slow_links.py --loss-seeds 1,2 --write $(BENCH_ARGS)
	$(PY) bench/slow_links.py --corpus once --contrast powersgd,fp32,diloco200 --write $(BENCH_ARGS)

lint: $(VENV)/.installed test-deps
	$(VENV)/bin/ruff check .
	shellcheck -x launch/*.sh launch/*.sbatch

# regenerate the shipped tiny corpus, tokenizer and DeepSpeed configs (deterministic)
assets: setup
	$(PY) scripts/make_tiny_assets.py
	$(PY) scripts/make_ds_configs.py

clean:
	rm -rf runs .pytest_cache .suite
