"""Tensor parallelism (DeepSpeed's AutoTP, 2 ranks) per model family: the sharded forward against the whole model's,
on the small random copy dstrain/families.py checks the other layouts on (issue 85).

    python scripts/family_tensor_parallel.py llama qwen3 lfm2 ...   # default: the families docs/models.md names
    python scripts/family_tensor_parallel.py --all --write           # every family the matrix builds (~20 min)

For each family: the one-line refusal train.py gives before anything is built (components/tensor_parallel.check_plan),
else two gloo processes on loopback build the same copy, deepspeed.initialize splits it with autotp_size 2 (ZeRO-0,
vocab_parallel_lm_head false as train.py sets it), and the largest logit difference against the unsplit copy and the
share of weights AutoTP split are printed. A cell needs both processes, so it is not part of the in-process matrix.
--write keeps the verdicts in dstrain/components/tensor_parallel_families.json (merged by family), which train.py
reads before a run with tensor_parallel (a family that differs, fails or is not listed is refused there), and writes
docs/models.md's table from it.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "smollm3",
            "olmo2", "olmo3", "granite", "glm4", "starcoder2", "gpt_neox", "exaone4", "gpt_oss", "deepseek_v3",
            "falcon_h1", "jamba", "lfm2", "qwen3_next", "granitemoehybrid", "bamba"]


def rank_main(rank: int, family: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_SIZE="2")
    warnings.filterwarnings("ignore")
    import copy
    import logging

    import deepspeed
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as tlog

    from dstrain import families
    from dstrain.parallel import ds_internals
    deepspeed.utils.logger.setLevel(logging.ERROR)
    tlog.set_verbosity_error()
    deepspeed.init_distributed(dist_backend="gloo")
    from dstrain.parallel import dist  # DeepSpeed's shared-memory workspace would outlive the rank: 64 MiB each
    dist.barrier()
    Path(dist.shm_buffer_path(rank)).unlink(missing_ok=True)
    small, model = families.runnable_copy(AutoConfig.for_model(family, **families.REPRESENTATIVE.get(family, {})))
    ids = torch.randint(0, small.vocab_size, (1, families.LENGTH), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=config)
    with torch.no_grad():
        got = engine.module(input_ids=ids).logits
    # the share of the weights between the embedding and the head: the copy keeps the family's vocabulary (a
    # 256k x 64 embedding outweighs its narrow layers)
    ends = (engine.module.get_input_embeddings(), engine.module.get_output_embeddings())
    split, whole = ds_internals.autotp_split_weights(engine.module, excluding=ends)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "difference": (got - want).abs().max().item() if got.shape == want.shape else None,
            "split": split * 2 / (split * 2 + whole) if split + whole else 0.0}))


def cell(family: str, timeout: int) -> dict:
    """One family: the refusal line, or the difference and the split share from two ranks."""
    from transformers import AutoConfig

    from dstrain.components.tensor_parallel import check_plan
    from dstrain.errors import UserError
    from dstrain.families import REPRESENTATIVE, small_copy
    try:
        check_plan(small_copy(AutoConfig.for_model(family, **REPRESENTATIVE.get(family, {}))), {})
    except UserError as e:
        return {"family": family, "refused": str(e)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ROOT / f".tp_probe_{os.getpid()}.json"
    code = ("import torch.multiprocessing as mp; from scripts.family_tensor_parallel import rank_main; "
            f"mp.spawn(rank_main, args=({family!r}, {port}, {str(out)!r}), nprocs=2)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"family": family, "error": f"no answer in {timeout} s"}
    try:
        if proc.returncode:
            lines = [line for line in proc.stderr.splitlines() if "Error" in line]
            return {"family": family, "error": (lines[-1] if lines else proc.stderr[-200:]).strip()[:200]}
        return {"family": family, **json.loads(out.read_text())}
    finally:
        out.unlink(missing_ok=True)


def row_of(r: dict) -> dict:
    """A cell's verdict as tensor_parallel_families.json keeps it (components/tensor_parallel.VERDICTS)."""
    family = r["family"]
    if "refused" in r:
        return {"family": family, "verdict": "plan", "why": r["refused"].split(": ", 1)[1].split(";")[0]}
    if "error" in r:
        return {"family": family, "verdict": "fails", "why": r["error"]}
    if r["difference"] is None or r["difference"] > 1e-4:
        return {"family": family, "verdict": "differs", "difference": r["difference"]}
    if r["split"] == 0:
        return {"family": family, "verdict": "splits nothing"}
    return {"family": family, "verdict": "exact", "difference": float(f"{r['difference']:.1e}"),
            "split": round(r["split"], 3)}


def write_docs(table: dict) -> None:
    """docs/models.md's table, between its two marker lines."""
    from dstrain.components import tensor_parallel as tp
    docs = ROOT / "docs/models.md"
    begin = "<!-- tensor parallelism: scripts/family_tensor_parallel.py --write writes between these lines -->"
    end = "<!-- end of the tensor-parallel table -->"
    head, rest = docs.read_text().split(begin)
    docs.write_text(head + begin + "\n" + tp.table(table) + "\n" + end + rest.split(end, 1)[1])


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*")
    parser.add_argument("--all", action="store_true", help="every family docs/family_matrix.json built small")
    parser.add_argument("--write", action="store_true", help="merge the verdicts into the package's table and "
                        "rewrite docs/models.md's")
    parser.add_argument("--docs", action="store_true", help="only rewrite docs/models.md's table from the package's")
    parser.add_argument("--timeout", type=int, default=180)
    args = parser.parse_args()
    if args.docs:
        from dstrain.components import tensor_parallel as tp
        write_docs(tp.verdicts())
        return
    import deepspeed
    import transformers

    from dstrain.components import tensor_parallel as tp
    families = args.families or FAMILIES
    if args.all:
        matrix = json.loads((ROOT / "docs/family_matrix.json").read_text())
        families = [r["family"] for r in matrix["rows"] if r["built"]]
    print(f"AutoTP on 2 gloo ranks, small random copies (dstrain/families.py); deepspeed {deepspeed.__version__}, "
          f"transformers {transformers.__version__}")
    print("| family | tensor parallelism (autotp_size 2) |\n|---|---|")
    rows = []
    for family in families:
        rows.append(row_of(cell(family, args.timeout)))
        print(f"| {family} | {tp.said(rows[-1])} |", flush=True)
    if args.write:
        known = {r["family"]: r for r in tp.verdicts()["rows"]} if tp.VERDICTS.is_file() else {}
        known.update({r["family"]: r for r in rows})
        table = {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                 "rows": sorted(known.values(), key=lambda r: r["family"])}
        tp.VERDICTS.write_text(json.dumps(table, indent=1) + "\n")
        write_docs(table)
        print(f"wrote {tp.VERDICTS.relative_to(ROOT)} ({len(table['rows'])} families) and docs/models.md's table")


if __name__ == "__main__":
    main()
