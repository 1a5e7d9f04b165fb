#!/usr/bin/env bash
# The checks only a CUDA GPU can run, in one go (docs/testing.md, "On a GPU"): tests/gpu (QLoRA, bf16/fp16 against
# the fp32 loop, issue 33's compressors and DiLoCo encodings against the CPU's), the gpu-1b speed bench against the
# Hugging Face Trainer, and the GPU-only configs (ZeRO++).
# Each step has its own time limit and log (the default steps together under 11 minutes: a lent GPU comes with 15
# minutes, its start included); a failing step does not stop the next. Issue 55's profile: `adam profile speed_plain
# loss_gap` (about 10 minutes). `make bench-gpu` runs it with
# the project's venv; elsewhere: PY=python3 OUT=/some/dir bash scripts/gpu_checks.sh [step ...]
set -u
cd "$(dirname "$0")/.." || exit
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/dstrain-gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
# bench/ imports dstrain (`make setup` installs it; a bare machine's python does not have it)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# one build of DeepSpeed's CUDA ops for this card only (a build for every architecture takes minutes); without a
# suffix, which the Trainer's DeepSpeed cannot parse (train.py drops it itself; the image of an H200 sets 9.0a)
TORCH_CUDA_ARCH_LIST=$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
export TORCH_CUDA_ARCH_LIST

step() {  # name, seconds, command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - start)) s"
    grep -E "passed|failed|error|Error|gap|tokens/s|MFU|TFLOP" "$OUT/$name.log" | grep -v "^  warnings" | tail -n 25
    [ $rc -eq 0 ] || tail -n 40 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch, deepspeed, transformers, peft, datasets; print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "datasets", datasets.__version__)'
steps=${*:-ops gpu_tests speed zeropp}
for s in $steps; do
    case $s in
    # into the keyed build directories train.py loads from (scripts/prebuild_ops.py, as `make setup`); before
    # 2026-11-27 this step built fused Adam into torch's default directory, which no run reads
    ops) step ops 200 "$PY" scripts/prebuild_ops.py FusedAdamBuilder QuantizerBuilder ;;
    adam) step adam 150 "$PY" scripts/prebuild_ops.py FusedAdamBuilder ;;  # ops without ZeRO++'s quantizer
    gpu_tests) step gpu_tests 280 "$PY" -m pytest tests/gpu -q -s -p no:cacheprovider -o addopts="" ;;
    speed) step speed 170 "$PY" bench/speed.py --preset gpu-1b --repeats 1 --systems dstrain hf_trainer --results "$OUT/speed.json" ;;
    # issue 55's first call: where train.py's step time goes against the plain loop's (kernel tables, host gaps;
    # both traces gzipped into $OUT), the floor (plain eager and compiled) beside train.py and the Trainer, and
    # the loss gap to the Trainer with and without its four settings aligned (bench/loss_gap.py)
    profile) step profile 200 "$PY" bench/profile_steps.py --preset gpu-1b --steps 12 --trace 9-10 --rows 30 \
        --keep "$OUT" --results "$OUT/profile.json" ;;
    speed_plain) step speed_plain 330 "$PY" bench/speed.py --preset gpu-1b --repeats 1 \
        --systems plain plain_compile dstrain hf_trainer --results "$OUT/speed_plain.json" ;;
    dpo) step dpo 240 "$PY" bench/dpo.py --preset gpu-1b --repeats 1 --steps 20 --skip 5 ;;  # issue 55 item 4
    loss_gap) step loss_gap 200 "$PY" bench/loss_gap.py --preset gpu-1b --stages 0 4 ;;  # 8 files come back: the log only
    zeropp) step zeropp 50 "$PY" train.py --ds_config zero3_zeropp.json --train.max_steps=20 --train.precision=bf16 \
        --eval.every=0 --log.wandb=false --log.progress_bar=false --checkpoint.every=0 --output_dir "$(mktemp -d)/run" ;;
    *) echo "unknown step $s" ;;
    esac
done
