"""Launch train.py for real, and an independent single-process PyTorch reference to compare against."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tests import warm

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def doc_commands(pages: list[Path] | None = None) -> list[tuple[str, str]]:
    """(where, command) for each command line in the pages' ```bash blocks: continuation lines joined, the
    trailing comment dropped."""
    found = []
    for page in pages or [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        lines, in_bash, pending = page.read_text().splitlines(), False, ""
        for number, line in enumerate(lines, 1):
            if line.startswith("```"):
                in_bash = not in_bash and line.strip() in ("```bash", "```sh")
                continue
            if not in_bash:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            command = re.sub(r"\s+#.*$", "", text).strip()
            if command and not command.startswith("#"):
                found.append((f"{page.relative_to(ROOT)}:{number}", command))
    return found


def train_argv(command: str) -> list[str] | None:
    """The arguments after train.py of a `... train.py ...` command (env assignments, launcher flags dropped)."""
    words = shlex.split(command.split("&&")[-1])
    return words[words.index("train.py") + 1:] if "train.py" in words else None



def readme_command(*words: str) -> list[str]:
    """The arguments after train.py of the one README command containing every word: tests run the README's
    commands as written (plus their own --output_dir and logging), so an edited command is what is tested."""
    found = [train_argv(c) for where, c in doc_commands([ROOT / "README.md"])
             if all(w in c for w in words) and train_argv(c) is not None]
    assert len(found) == 1, f"README has {len(found)} train.py commands with {words}"
    return found[0]


_PORTS_PER_WORKER = 3000
_next_port: list[int] = []


def free_port() -> int:
    """A free TCP port for a launch's master (or a test server), below the ephemeral range (dstrain.parallel.dist.free_port
    says why). Each xdist worker draws from its own block, in turn, so two workers never pick the same one and a
    worker does not reuse a port that its previous run may still hold while exiting."""
    from dstrain.parallel.dist import free_port as pick

    if not _next_port:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        block = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
        low = 12000 + block * _PORTS_PER_WORKER
        _next_port.extend([low, os.getpid() % _PORTS_PER_WORKER])
    low, offset = _next_port
    port = pick(low, low + _PORTS_PER_WORKER, start=offset)
    _next_port[1] = port - low + 1
    return port


def tracebacks(err: str) -> list[str]:
    """Each Python traceback in err: from its "Traceback" line to the exception line (the first unindented)."""
    blocks, lines = [], err.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j].startswith(" ")), len(lines))
            blocks.append("\n".join(lines[i:end + 1]))
    return blocks


def processes_below(pid: int, *words: str) -> list:
    """The live processes under `pid` whose command line holds every word. One that has just exited (a zombie
    until its parent reaps it: a launcher's helper, a rank a test killed) is passed over, not an error."""
    import psutil
    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if all(word in line for word in words):
            found.append(proc)
    return found


def kill_rank_after_checkpoint(args: list[str], run_dir: Path, cache: Path, step: int, rank: int,
                               nproc: int = 2) -> subprocess.CompletedProcess:
    """train.py under the deepspeed runner, as a user starts it; SIGKILL local rank `rank` once checkpoint `step` is
    published. Rank 0 holds still just after publishing it (whenever a busy machine's background writer lets that
    happen), so the kill lands mid-run, and the runner then ends the others. Slowing a step instead held the
    publication too (it waits for every rank at a step boundary): 60 s lost in CI. Output: stdout and stderr."""
    import signal
    import time
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), "train.py", *args]
    fault = f"save:prune:slow:rank=0:step={step}:seconds=60"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(cache, DSTRAIN_FAULT=fault), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (run_dir / "checkpoints" / f"step_{step:08d}" / "complete.json").exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        ranks = processes_below(proc.pid, "train.py", f"--local_rank={rank}")
        assert len(ranks) == 1, ranks
        ranks[0].send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it (launch/ scripts start the launcher in its own session, so
    killing the script's process group would leave the ranks running)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    # and until they are gone: a killed process still holds its files (a run's lock) while the kernel tears it down,
    # and a warm relaunch reaches the lock within milliseconds ("is in use by another run": seen, a fresh clone of
    # 5d5f690). The caller waits for its own child, `pid` (reaped here, its exit status would be lost)
    psutil.wait_procs([proc for proc in procs if proc.pid != pid], timeout=60)


def env(cache: Path, **extra) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DSTRAIN_CACHE=str(cache),
             WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    e.pop("WANDB_API_KEY", None)
    # a caller's MALLOC_MMAP_THRESHOLD_ makes freed tensors leave RSS at once, which the memory tests need, at the
    # price of page faults for every tensor (steps 1.5x slower here, docs/planning.md). Tests that measure memory
    # set it themselves.
    e.pop("MALLOC_MMAP_THRESHOLD_", None)
    e.update(extra)
    return e


def launch(args: list[str], cache: Path, launcher: str | None = None, nproc: int = 2, check: bool = True,
           timeout: int = 600, **extra_env) -> subprocess.CompletedProcess:
    """One training job. Without a `launcher`, a run expected to succeed runs on warm ranks (tests/warm.py: forks
    of a process that imported torch, DeepSpeed and transformers once, with torchrun's rank variables) and one
    that may fail (check=False) under the deepspeed runner, as a user starts it: the runner passes a rank's own
    exit code (75, 2, ...) on, where torchrun reports any failure as 1 with a traceback of its own. "warm-python"
    is one warm process without rank variables, as `python train.py`. The real launchers: "deepspeed", "torchrun"
    (4 s sooner than the runner, which and then its launch.py import deepspeed first), "python", "accelerate".
    Tests of what a person does to a run (signals, kills, bad input, a launcher's own behaviour) name theirs.
    DSTRAIN_TEST_LAUNCH=real runs the warm launches with torchrun / python instead (the suite as it was before
    issue 83, to compare); so does an environment a fork cannot give (warm.can_fork)."""
    launcher = launcher or ("warm" if check else "deepspeed")
    environ = env(cache, **extra_env)
    real = {"warm": "torchrun", "warm-python": "python"}.get(launcher, launcher)  # what ran here before issue 83
    blocked = []  # a warm launch run for real for its environment: the variables (the suite's report counts them)
    if launcher in ("warm", "warm-python") and (os.environ.get("DSTRAIN_TEST_LAUNCH") == "real" or
                                                (blocked := warm.unforkable(environ))):
        launcher = real
    began = time.monotonic()
    try:
        return _launch(args, environ, launcher, nproc, check, timeout)
    finally:
        if os.environ.get("DSTRAIN_TEST_LAUNCH_LOG"):  # make test counts the launches of each kind and their seconds
            with open(os.environ["DSTRAIN_TEST_LAUNCH_LOG"], "a") as log:  # (suite_report.py)
                test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
                log.write(f"{launcher}\t{real}\t{time.monotonic() - began:.1f}\t{test}\t{','.join(blocked)}\n")


def _launch(args: list[str], environ: dict, launcher: str, nproc: int, check: bool,
            timeout: int) -> subprocess.CompletedProcess:
    if launcher in ("warm", "warm-python"):
        port = free_port()
        try:
            proc = warm.launch(args, environ, nproc if launcher == "warm" else 1, port, timeout,
                               distributed=launcher == "warm")
        except TimeoutError as error:
            raise AssertionError(f"warm train.py {' '.join(args)} {error}") from None
        return _checked(proc, check, port)
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, "train.py"]
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port, "train.py"]
    elif launcher == "python":
        cmd = [sys.executable, "train.py"]
    elif launcher == "accelerate":
        cmd = [str(BIN / "accelerate"), "launch", "--num_processes", str(nproc), "--num_machines", "1",
               "--main_process_port", port, "--use_deepspeed", "--deepspeed_config_file",
               str(ROOT / "ds_configs" / "zero1.json"), "--mixed_precision", "no", "train.py"]
    else:
        raise ValueError(launcher)
    # own session, so a timeout kills the launcher's ranks too, not only the launcher
    with subprocess.Popen(cmd + args, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(popen.pid)
            out, err = popen.communicate()
            raise AssertionError(f"{' '.join(cmd + args)} ran past {timeout}s\n--- stderr\n{err[-6000:]}") from None
    return _checked(subprocess.CompletedProcess(cmd + args, popen.returncode, out, err), check, port)


def _checked(proc: subprocess.CompletedProcess, check: bool, port) -> subprocess.CompletedProcess:
    # DeepSpeed's CPU shm allreduce leaves a 64 MiB /dev/shm file per rank unless train.py removes it;
    # left there, a suite's worth of runs filled RAM and got CI OOM-killed.
    leaked = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    for path in leaked:
        os.unlink(path)
    assert not leaked, f"run left shared memory behind: {leaked}"
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> tuple[list[float], list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def reference_losses(model_dir: Path, run_dir: Path, steps: int, lr: float, warmup: int, min_lr_ratio: float,
                     weight_decay: float, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0, seed=42,
                     lr_scale: float = 1.0, record: dict | None = None, sequences: torch.Tensor | None = None,
                     lora: dict | None = None, dpo_beta: float | None = None, topk: dict | None = None,
                     skip: tuple = (), stop_after: int | None = None, muon: dict | None = None,
                     router_aux: dict | None = None):
    """Plain PyTorch: one process, whole global batch per step, torch AdamW, hand-written cosine schedule.

    Shares nothing with dstrain but the tokenized data (read from the run's cache) and the documented
    sampling contract: global batch s holds stream samples [s*G, (s+1)*G), sample k being element k % n of
    numpy's permutation seeded by (seed, k // n). `record`, when given, receives per-step lists: grad_norm (the
    pre-clip global norm, which AdamW's scale invariance and clipping hide from the losses), tokens (input
    tokens that are not padding) and label_tokens. Packed rows (a position_ids column) reach the model with their
    position_ids and no mask: transformers builds the per-document causal mask itself. `sequences`, when given, replaces the run's tokenized cache
    (the caller tokenized the data itself). `lora`, when given, is peft's LoraConfig keywords: adapters are added
    with peft's get_peft_model right after torch.manual_seed(seed) (the documented adapter-init contract) and only
    they train. `dpo_beta`, when given: the rows are preference pairs and the loss is DPO's (sigmoid) mean over the
    global batch's pairs, the reference being the model as loaded, in eval mode, run beside the policy (no stored
    log-probs), and each side's log-prob a log_softmax/gather sum over its response tokens. `topk`, when given
    ({"world", "micro", "fraction", "warmup", "exempt"}): from optimizer step `warmup` on, each of `world` data-parallel
    ranks' gradient is computed on its share of the global batch (micro-batch m of rank r holds positions
    (m x world + r) x micro ...), and each matrix's is cut to its fraction largest-magnitude entries plus the
    rank's carried-over remainder (error feedback), the cut ones summed over the ranks and averaged; vectors
    and the `exempt` shapes (the embedding) averaged whole. Written from the method's definition. `skip`: the
    (1-based) steps whose update is left out: their loss is taken, no weight or optimizer state changes and the
    schedule does not advance (the next step has the skipped one's learning rate). `stop_after`: the steps run
    (default `steps`, which also sets the schedule's length). `muon`, when given ({"lr", "momentum", "dtype"}): the
    trained matrices that are not embeddings (nn.Embedding weights, the output embeddings) take Muon's update
    (muon_step, written from Jordan et al.'s definition), at muon["lr"] x the same schedule, decayed by
    lr x weight_decay; the rest keep torch AdamW. `router_aux`, when given ({"coef", "micro"}): a Mixture-of-Experts
    model's loss adds coef x the mean of transformers' own aux_loss over the global batch's micro-batches (consecutive
    runs of `micro` rows, each a forward with output_router_logits), and `record` gets the per-step aux_loss and
    lm_loss."""
    import datasets
    from transformers import AutoModelForCausalLM

    info = json.loads((run_dir / "run_info.json").read_text())
    recipe_ds = json.loads((run_dir / "ds_config.json").read_text())
    global_batch = info.get("global_batch", recipe_ds["train_batch_size"])
    train = {"input_ids": sequences} if sequences is not None else \
        datasets.load_from_disk(info["data_cache"])["train"].with_format("torch")
    n = len(train["chosen_input_ids" if dpo_beta is not None else "input_ids"])

    def indices(step):
        return [int(np.random.default_rng([seed, k // n]).permutation(n)[k % n])
                for k in range(step * global_batch, (step + 1) * global_batch)]

    if dpo_beta is not None:
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def batch(step):
        idx = indices(step)
        rows = {"input_ids": train["input_ids"][idx]} if sequences is not None else train[idx]
        labels = rows["labels"] if "labels" in rows else rows["input_ids"]
        return rows["input_ids"].long(), labels.long(), rows.get("attention_mask"), rows.get("position_ids")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    orthogonalised = []
    if muon is not None:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        embeddings.add(id(model.get_output_embeddings().weight))
        orthogonalised = [p for p in trained if p.ndim == 2 and id(p) not in embeddings]
        momenta = [torch.zeros_like(p) for p in orthogonalised]
    adamw = [p for p in trained if all(p is not q for q in orthogonalised)]
    decay = [p for p in adamw if p.ndim >= 2]
    no_decay = [p for p in adamw if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr * lr_scale, betas=betas, eps=eps)

    def factor(s):  # s = 1-based step
        if s <= warmup:
            return s / warmup
        p = (s - warmup) / (steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * (1 + math.cos(math.pi * p)) / 2

    losses = []
    errors: dict = {}  # topk: (rank, parameter index) -> the remainder not sent yet
    applied = 0
    for step in range(stop_after or steps):
        for group in opt.param_groups:
            group["lr"] = lr * lr_scale * factor(applied + 1)
        if topk is not None and step >= topk["warmup"]:
            loss, target, real = _topk_step(model, batch(step), trained, topk, errors)
        elif dpo_beta is not None:
            loss, target, real = _dpo_loss(model, reference, train[indices(step)], dpo_beta)
        else:
            loss, target, real = _lm_loss(model, *batch(step))
        if router_aux is not None:
            lm_loss, (aux, load) = loss, _router_aux_loss(model, *batch(step), router_aux["micro"])
            loss = lm_loss + router_aux["coef"] * aux
            if record is not None:
                record.setdefault("aux_loss", []).append(aux.item())
                record.setdefault("lm_loss", []).append(lm_loss.item())
                record.setdefault("expert_load", []).append(load)
        if topk is None or step < topk["warmup"]:
            for p in trained:  # opt holds only AdamW's share under muon
                p.grad = None
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trained, max_grad_norm if max_grad_norm else float("inf"))
        if step + 1 not in skip:
            opt.step()
            if muon is not None:
                muon_step(orthogonalised, momenta, muon["lr"] * factor(applied + 1), muon["momentum"], weight_decay,
                          muon.get("dtype", torch.float32))
            applied += 1
        losses.append(loss.item())
        if record is not None:
            record.setdefault("grad_norm", []).append(norm.item())
            record.setdefault("tokens", []).append(real)
            record.setdefault("label_tokens", []).append(int((target != -100).sum()))
    return losses, model


def newton_schulz(g: torch.Tensor, dtype: torch.dtype, steps: int = 5) -> torch.Tensor:
    """The matrix nearest-orthogonal to g, roughly (singular values pushed into about [0.7, 1.2]): Jordan et al.'s
    quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, from X = g / |g|_F, on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = (g.T if tall else g).float()
    x = (x / (x.norm() + 1e-7)).to(dtype)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


@torch.no_grad()
def muon_step(params, momenta, lr: float, beta: float, weight_decay: float, dtype: torch.dtype) -> None:
    """Muon on each matrix: momentum m <- beta m + (1 - beta) g; Nesterov's look-ahead u = beta m + (1 - beta) g;
    the update is newton_schulz(u) x sqrt(max(1, rows / cols)), after decoupled weight decay."""
    for p, m in zip(params, momenta):
        g = p.grad
        m.mul_(beta).add_(g, alpha=1 - beta)
        u = g * (1 - beta) + m * beta
        scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        p.mul_(1 - lr * weight_decay)
        p.add_(newton_schulz(u, dtype) * scale, alpha=-lr)


def _topk_step(model, rows, params, topk: dict, errors: dict):
    """Sets each parameter's .grad as topk compression with error feedback over topk["world"] ranks would; returns
    (the mean of the ranks' losses, all shifted labels, the real input tokens)."""
    world, micro = topk["world"], topk["micro"]
    per_rank = []
    losses = []
    for r in range(world):
        share = [i for i in range(rows[0].shape[0]) if (i // micro) % world == r]
        model.zero_grad()
        loss, _, _ = _lm_loss(model, *(t[share] if t is not None else None for t in rows))
        loss.backward()
        per_rank.append([p.grad.clone() for p in params])
        losses.append(loss)
    for i, p in enumerate(params):
        if p.ndim < 2 or tuple(p.shape) in topk["exempt"]:
            p.grad = sum(g[i] for g in per_rank) / world
            continue
        total = torch.zeros(p.numel())
        for r in range(world):
            corrected = per_rank[r][i].reshape(-1) + errors.get((r, i), 0.0)
            keep = corrected.abs().topk(math.ceil(topk["fraction"] * p.numel())).indices
            total.index_add_(0, keep, corrected[keep])
            corrected[keep] = 0.0
            errors[(r, i)] = corrected
        p.grad = (total / world).view_as(p)
    input_ids, labels, mask, _ = rows
    return sum(losses) / world, labels[:, 1:], int(mask.sum()) if mask is not None else input_ids.numel()


def _lm_loss(model, input_ids, labels, mask, positions):
    """(mean next-token loss over the label tokens, the shifted labels, the real input tokens)."""
    if positions is not None:  # packed rows: transformers keeps attention within each document (position_ids),
        # but only without a cache: with use_cache it skips the packed-row detection and attends across documents
        logits = model(input_ids=input_ids, position_ids=positions.long(), use_cache=False).logits
    else:
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    target = labels[:, 1:]
    loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), target.reshape(-1),
                               ignore_index=-100, reduction="sum")
    return loss_sum / (target != -100).sum(), target, int(mask.sum()) if mask is not None else input_ids.numel()


def _router_aux_loss(model, input_ids, labels, mask, positions, micro: int) -> tuple[torch.Tensor, np.ndarray]:
    """The mean over consecutive `micro`-row micro-batches of the model's own load-balancing loss, and the tokens
    each MoE layer's router sent to each expert over the whole batch ([layers, experts]: softmax, top-k, bincount;
    padding left out)."""
    losses, load = [], 0
    top_k = model.config.num_experts_per_tok
    for i in range(0, len(input_ids), micro):
        rows = slice(i, i + micro)
        inputs = {"position_ids": positions[rows].long()} if positions is not None else \
            {"attention_mask": mask[rows] if mask is not None else None}
        out = model(input_ids=input_ids[rows], use_cache=False, output_router_logits=True, **inputs)
        losses.append(out.aux_loss)
        real = mask[rows].reshape(-1).bool() if mask is not None else slice(None)
        load = load + np.array([np.bincount(torch.topk(torch.softmax(layer.detach(), -1), top_k).indices[real]
                                            .reshape(-1).numpy(), minlength=layer.shape[-1])
                                for layer in out.router_logits])
    return torch.stack(losses).mean(), load


def response_logps(model, rows, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    labels = rows[f"{side}_labels"].long()
    logits = model(input_ids=rows[f"{side}_input_ids"].long(), attention_mask=rows[f"{side}_attention_mask"]).logits
    target = labels[:, 1:]
    per_token = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, target.clamp(min=0)[..., None]).squeeze(2)
    return (per_token * (target != -100)).sum(1), target


def _dpo_loss(model, reference, rows, beta: float):
    """DPO (sigmoid) over a batch of pairs: (mean loss, both sides' shifted labels, the real input tokens). The
    rows are cut to the batch's longest pair rounded up to 16 tokens (the documented padding rule: CPU attention
    kernels round differently at other lengths, by 1e-5)."""
    longest = max(int(rows[f"{side}_attention_mask"].sum(1).max()) for side in ("chosen", "rejected"))
    keep = -(-longest // 16) * 16
    rows = {k: v[:, :keep] if k.startswith(("chosen_", "rejected_")) else v for k, v in rows.items()}
    (pc, tc), (pr, tr) = response_logps(model, rows, "chosen"), response_logps(model, rows, "rejected")
    with torch.no_grad():
        rc, rr = response_logps(reference, rows, "chosen")[0], response_logps(reference, rows, "rejected")[0]
    loss = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    real = int(rows["chosen_attention_mask"].sum() + rows["rejected_attention_mask"].sum())
    return loss, torch.cat([tc, tr]), real


def reference_eval(model, run_dir: Path, data_parallel: int, micro_batch_size: int, max_batches: int | None) -> float:
    """The eval loss by the documented contract, in plain PyTorch: data-parallel rank r evaluates validation
    samples r, r + dp, ... (an equal share per rank), in micro-batches, the first max_batches of them; the loss is
    summed over every label token of every rank and divided by their count."""
    import datasets

    info = json.loads((run_dir / "run_info.json").read_text())
    val = datasets.load_from_disk(info["data_cache"])["validation"].with_format("torch")
    per_rank = len(val) // data_parallel
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for rank in range(data_parallel):
            idx = list(range(rank, per_rank * data_parallel, data_parallel))
            batches = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)][:max_batches]
            for batch in batches:
                rows = val[batch]
                input_ids = rows["input_ids"].long()
                labels = (rows["labels"] if "labels" in rows else rows["input_ids"]).long()
                if "position_ids" in rows:
                    logits = model(input_ids=input_ids, position_ids=rows["position_ids"].long(),
                                   use_cache=False).logits
                else:
                    logits = model(input_ids=input_ids, attention_mask=rows.get("attention_mask")).logits
                target = labels[:, 1:]
                total += F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), target.reshape(-1),
                                         ignore_index=-100, reduction="sum").item()
                count += int((target != -100).sum())
    return total / count


def assert_resume_exact(tmp_path: Path, cache: Path, model_dir: Path, ds_config: str, split_only: tuple = ()) -> None:
    """Stop at step 4 (train.exit_at_step), resume, and get the losses of an uninterrupted 10-step run.
    `split_only`: arguments of the stopped and resumed runs alone (what must change nothing)."""
    import pytest

    args = ["--train.max_steps=10", "--train.warmup_steps=2", "--train.micro_batch_size=4",
            "--train.grad_accum_steps=2", "--train.seq_len=64", "--eval.max_batches=2", "--log.wandb=false",
            "--log.progress_bar=false", "--ds_config", ds_config, f"--model.name_or_path={model_dir}"]
    launch(args + ["--output_dir", str(tmp_path / "whole"), "--checkpoint.every=0"], cache)
    launch(args + ["--output_dir", str(tmp_path / "split"), "--train.exit_at_step=4", *split_only], cache)
    launch(args + ["--output_dir", str(tmp_path / "split"), *split_only], cache)
    want, _ = metrics(tmp_path / "whole")
    got, _ = metrics(tmp_path / "split")
    assert len(got) == 10 and got == pytest.approx(want, rel=1e-6, abs=0)


def diloco_reference_losses(model_dir: Path, run_dir: Path, steps: int, lr: float, warmup: int, min_lr_ratio: float,
                            weight_decay: float, world: int, replicas: int, micro: int, every: int, outer_lr: float,
                            outer_momentum: float, dtype: str = "fp32", betas=(0.9, 0.95), eps=1e-8,
                            max_grad_norm=1.0, seed=42, regroups: tuple = (), averaged_first: int = 0,
                            lora: dict | None = None, final: dict | None = None, fragments: int = 1,
                            overlap: int = 0, mix: float = 0.5, evals: dict | None = None,
                            eval_batches: int = 2, stages: tuple = ()) -> list[float]:
    """DiLoCo written from the paper (Douillard et al. 2023, Algorithm 1), in one process: `replicas` copies of the
    model, each with its own torch AdamW and the hand-written cosine schedule. Global batch s is the documented
    stream slice; position i of it belongs to rank (i // micro) % world and ranks are grouped into replicas of
    world / replicas consecutive ranks. Each copy takes the gradient of its replica's mean loss, clipped by its own
    norm. After every `every` steps and after the last, the outer step: the pseudo-gradients (shared weights minus
    each copy's) averaged, set as the gradient of the shared weights and applied by torch.optim.SGD (Nesterov when
    outer_momentum > 0); each copy then loads the shared weights and keeps its AdamW state. dtype bf16: each copy's
    pseudo-gradient plus its carried rounding error is rounded to bf16 and the error carried to the next sync; int8:
    the same with int8 codes and a scale (the largest magnitude) per 128 consecutive elements of the parameters
    laid end to end in model order. `regroups`, (after_step, world, replicas) each: after that many steps (a sync)
    the ranks form that many replicas of the same size; copy k goes on as copy k mod (replicas before) left it
    (its weights and AdamW state; a copy past the new count is dropped), the carried rounding starts from zero.
    `averaged_first` (diloco.warmup_steps): after each of that many first steps the shared weights become the
    copies' average (the pseudo-gradients rounded to bf16 where dtype is int8/int4, subtracted whole), the outer
    SGD untouched. `lora`: peft's LoraConfig keywords; the adapters peft makes right after torch.manual_seed(seed)
    are what trains (AdamW, the pseudo-gradients and the outer step cover them only), the base stays frozen.
    `final`, when given, receives the shared weights at the end (name -> tensor); `evals`, {step: ...}, the shared
    weights' eval loss after each of those steps (reference_eval over `world` ranks, `eval_batches` each).
    Streaming DiLoCo (Douillard et al. 2025), `fragments` P > 1 or `overlap` tau > 0, written out by hand on the
    trained parameters laid end to end (N elements): fragment p is [b_p, b_p+1), b_p = floor(p N / P) rounded down
    to a multiple of 128 (b_P = N); after step s (past averaged_first) where s mod every = floor((p+1) every / P)
    mod every, each copy's pseudo-gradient of fragment p (plus its carried rounding) is rounded and averaged; tau
    steps later (before that step's own sends) the outer Nesterov step moves the shared weights of fragment p
    (buf = mu buf + g, w -= lr (g + mu buf), buf starting at 0) and each copy's weights there become mix x its own +
    (1 - mix) x the shared ones (the shared ones when tau = 0). After the last step everything still in flight
    lands, then the whole model syncs (the shared weights to every copy). `stages`, the elements of each pipeline
    stage's part of that vector (consecutive; the whole vector when empty): each stage's part is cut into the P
    fragments and rounded in blocks from its own start, fragment p being the stages' p-th pieces together.
    Returns the logged losses: every copy's summed token loss over all label tokens of the global batch."""
    import copy

    import datasets
    from transformers import AutoModelForCausalLM

    info = json.loads((run_dir / "run_info.json").read_text())
    train = datasets.load_from_disk(info["data_cache"])["train"].with_format("torch")
    n = len(train["input_ids"])
    size = world // replicas
    last_replicas = regroups[-1][2] if regroups else replicas  # the run's ds_config.json is its last launch's
    global_batch = json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] * last_replicas
    regroup_at = {after: (w, r) for after, w, r in regroups}

    def rows_of(step: int, replica: int):
        idx = [int(np.random.default_rng([seed, k // n]).permutation(n)[k % n])
               for k in range(step * global_batch, (step + 1) * global_batch)]
        mine = [j for i, j in enumerate(idx) if ((i // micro) % world) // size == replica]
        rows = train[mine]
        labels = rows["labels"] if "labels" in rows else rows["input_ids"]
        return rows["input_ids"].long(), labels.long(), rows.get("attention_mask"), rows.get("position_ids")

    shared = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(seed)
        shared = get_peft_model(shared, LoraConfig(task_type="CAUSAL_LM", **lora))

    def trained(m):
        return [p for p in m.parameters() if p.requires_grad]

    def adamw(m):
        return torch.optim.AdamW([{"params": [p for p in trained(m) if p.ndim >= 2], "weight_decay": weight_decay},
                                  {"params": [p for p in trained(m) if p.ndim < 2], "weight_decay": 0.0}],
                                 lr=lr, betas=betas, eps=eps)

    copies = [copy.deepcopy(shared).train() for _ in range(replicas)]
    opts = [adamw(m) for m in copies]
    outer = torch.optim.SGD(trained(shared), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    carry = [0.0] * replicas

    def factor(s):
        if s <= warmup:
            return s / warmup
        p = (s - warmup) / (steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * (1 + math.cos(math.pi * p)) / 2

    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    numel = sum(p.numel() for p in trained(shared))
    sizes = stages or (numel,)
    assert sum(sizes) == numel, (sizes, numel)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def cut(n):  # b_0 .. b_P of one stage's part (of the whole vector without stages)
        return [min(n, (p * n // fragments) // 128 * 128) for p in range(fragments)] + [n]

    # fragment p: its (lo, hi) in each stage
    pieces = [[(o + b[p], o + b[p + 1]) for o, b in zip(starts, map(cut, sizes))] for p in range(fragments)]
    buf, flights = torch.zeros(numel), []

    def send(lo, hi):
        with torch.no_grad():
            anchor = parameters_to_vector(trained(shared))[lo:hi]
            mean = torch.zeros(hi - lo)
            for k, model in enumerate(copies):
                if not torch.is_tensor(carry[k]):
                    carry[k] = torch.zeros(numel)
                delta = anchor - parameters_to_vector(trained(model))[lo:hi] + carry[k][lo:hi]
                sent = delta if dtype == "fp32" else delta.to(torch.bfloat16).float() if dtype == "bf16" else \
                    _int_round(delta, 127 if dtype == "int8" else 7)
                carry[k][lo:hi] = delta - sent
                mean += sent
            return mean / replicas

    def land(lo, hi, mean, weight):
        with torch.no_grad():
            anchor = parameters_to_vector(trained(shared))
            if outer_momentum > 0:
                buf[lo:hi] = outer_momentum * buf[lo:hi] + mean
                mean = mean + outer_momentum * buf[lo:hi]
            anchor[lo:hi] -= outer_lr * mean
            vector_to_parameters(anchor, trained(shared))
            for model in copies:
                local = parameters_to_vector(trained(model))
                local[lo:hi] = weight * local[lo:hi] + (1 - weight) * anchor[lo:hi] if weight else anchor[lo:hi]
                vector_to_parameters(local, trained(model))

    def streamed(s):
        for flight in [f for f in flights if f[0] == s]:
            flights.remove(flight)
            land(*flight[1:])
        if s == steps:
            for flight in list(flights):
                land(*flight[1:])
            flights.clear()
            for o, n in zip(starts, sizes):
                land(o, o + n, send(o, o + n), 0.0)
            return
        for p in range(fragments):
            if s % every == (p + 1) * every // fragments % every:
                for lo, hi in pieces[p]:
                    if overlap:
                        flights.append((s + overlap, lo, hi, send(lo, hi), mix))
                    else:
                        land(lo, hi, send(lo, hi), 0.0)

    losses = []
    for step in range(steps):
        total, count = 0.0, 0
        for model, opt, k in zip(copies, opts, range(replicas)):
            for group in opt.param_groups:
                group["lr"] = lr * factor(step + 1)
            loss, target, _ = _lm_loss(model, *rows_of(step, k))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            tokens = int((target != -100).sum())
            total, count = total + loss.item() * tokens, count + tokens
        losses.append(total / count)
        averaged = step + 1 <= averaged_first
        if (fragments > 1 or overlap) and not averaged:
            streamed(step + 1)
        elif averaged or (step + 1) % every == 0 or step + 1 == steps:
            with torch.no_grad():
                params = trained(shared)
                deltas = []
                for k, model in enumerate(copies):
                    delta = torch.cat([(p - q).reshape(-1) for p, q in zip(params, trained(model))])
                    wire = "bf16" if averaged and dtype in ("int8", "int4") else dtype
                    if wire != "fp32":
                        delta = delta + carry[k]
                        sent = delta.to(torch.bfloat16).float() if wire == "bf16" else \
                            _int_round(delta, 127 if wire == "int8" else 7)
                        carry[k] = delta - sent
                        delta = sent
                    deltas.append(delta)
                mean = sum(deltas) / replicas
                for p, g in zip(params, torch.split(mean, [p.numel() for p in params])):
                    if averaged:
                        p.sub_(g.view_as(p))
                    else:
                        p.grad = g.view_as(p).clone()
            if not averaged:
                outer.step()
            for model in copies:
                model.load_state_dict(shared.state_dict())
        if evals is not None and step + 1 in evals:
            evals[step + 1] = reference_eval(shared, run_dir, world, micro, eval_batches)
        if step + 1 in regroup_at:
            world, new = regroup_at[step + 1]
            size = world // new
            for k in range(replicas, new):
                src = k % replicas
                copies.append(copy.deepcopy(copies[src]))
                opts.append(adamw(copies[-1]))
                opts[-1].load_state_dict(copy.deepcopy(opts[src].state_dict()))
            copies, opts, replicas, carry = copies[:new], opts[:new], new, [0.0] * new
    if final is not None:
        final.update({name: p.detach().clone() for name, p in shared.named_parameters()})
    return losses


def _int_round(values: torch.Tensor, levels: int = 127, block: int = 128) -> torch.Tensor:
    """values as integer codes with one scale per block of `block` elements bring them back: round(v / m x L) x m /
    L, m the block's largest magnitude (L = 127: int8, 7: int4)."""
    n = values.numel()
    padded = torch.cat([values, values.new_zeros(-n % block)]).view(-1, block)
    top = padded.abs().max(1, keepdim=True).values.clamp_min(1e-30)
    return (torch.round(padded / top * levels) * (top / levels)).reshape(-1)[:n]
