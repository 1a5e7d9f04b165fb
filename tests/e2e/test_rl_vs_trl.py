"""Learning from rewards against TRL 1.16 itself (issue 56): the same prompts, the same completions (fed to both,
tests/fed_rollouts.py: nothing is sampled twice), the same reward functions and starting weights. A 2-rank run
(ZeRO-3 with its parameters partitioned, persistence threshold 0; one case each under ZeRO-0, ZeRO-1 and ZeRO-2
with the optimizer offloaded to the CPU) against TRL's GRPOTrainer / RLOOTrainer in this process on
one CPU, both fp32 with AdamW at a constant learning rate: per-step loss, pre-clip gradient norm, entropy and the
reward metrics, for each GRPO loss type and for RLOO. With one update per rollout the loss is a function of the
advantages and masks; the gradient norm and the entropy, steps 2 and 3, are what the weights after each update
make of the same sequences, so a wrong gradient, normalisation or update shows there."""
import json

import pytest
import torch

from tests import fed_rollouts
from tests.helpers import launch

STEPS, LR, G, PROMPTS = 3, 1e-3, 4, ["Ada had two red lamps. Now Ada has", "Sam ran. Sam has",
                                     "It was a warm day. Yuki had one stone and Kofi gave Yuki eight more. Now Yuki has",
                                     "Lena has"]
TEMPERATURE = 0.9  # the log-probs are those of logits / temperature on both sides
PARTITIONED = ["--ds.zero_optimization.stage3_param_persistence_threshold=0"]
COMPARED = ["loss", "grad_norm", "entropy", "reward", "reward_std", "rewards/vowels/mean", "rewards/brevity/mean",
            "rewards/vowels/std", "rewards/brevity/std", "completions/mean_length", "completions/clipped_ratio"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "three"}) + "\n" for p in PROMPTS))
    return path


def ours(tmp_path, cache, model_dir, data, extra, ds_config="zero3.json", steps=STEPS) -> list[dict]:
    run = tmp_path / "run"
    proc = launch(["--ds_config", ds_config, *(PARTITIONED if ds_config == "zero3.json" else []), f"--model.name_or_path={model_dir}", f"--data.path={data}",
            "--data.format=prompt", "--data.val_fraction=0", "--output_dir", str(run),
            "--rl.reward_funcs=[tests/fed_rollouts.py:vowels,tests/fed_rollouts.py:brevity]",
            "--rl.reward_weights=[1.0,2.0]", "--rl.rollout_engine=tests/fed_rollouts.py:Fed",
            f"--rl.num_generations={G}", f"--rl.max_completion_length={fed_rollouts.MAX_LEN}",
            f"--rl.temperature={TEMPERATURE}", f"--train.max_steps={steps}", f"--train.lr={LR}",
            "--train.warmup_steps=0", "--train.min_lr_ratio=1.0", "--train.weight_decay=0.0",
            "--train.precision=fp32", "--train.micro_batch_size=2", "--train.seq_len=48", "--eval.every=0",
            "--log.wandb=false", "--log.progress_bar=false", "--checkpoint.every=0", "--checkpoint.export_hf=false",
            *extra], cache)
    rows = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert_summary_leads_with(proc.stderr, run, "reward", f"{rows[0]['reward']:.3f} (step 1) -> "
                                                          f"{rows[-1]['reward']:.3f} (step {rows[-1]['step']})")
    return rows


def assert_summary_leads_with(stderr: str, run, name: str, figures: str) -> None:
    """Issue 69: a GRPO run's summary showed `loss 0.0000  eval loss -` and no reward, a distillation run's no KL:
    the objective's own figure is the summary's first, as in summary.json."""
    lines = stderr.splitlines()
    first = lines[next(i for i, line in enumerate(lines) if line.startswith("run finished")) + 1]
    assert first == f"  {name} {figures}", first
    assert json.loads((run / "summary.json").read_text())["headline"]["name"] == name


def theirs(tmp_path, model_dir, algorithm: str, beta: float = 0.0, peft_config=None, learning_rate=LR,
           steps=STEPS, **config) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from tests.fed_rollouts import brevity, for_trl, vowels
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    common = dict(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, per_device_train_batch_size=len(PROMPTS) * G,
                  gradient_accumulation_steps=1, num_generations=G, max_completion_length=fed_rollouts.MAX_LEN,
                  temperature=TEMPERATURE, learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
                  max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", gradient_checkpointing=False,
                  beta=beta, reward_weights=[1.0, 2.0], dataloader_num_workers=0, seed=42, **config)
    data = datasets.Dataset.from_list([{"prompt": p, "answer": "three"} for p in PROMPTS])
    if algorithm == "grpo":
        def rollout(prompts, trainer):
            ids = trainer._tokenize_prompts(prompts)[0]  # TRL's own tokenization of the prompts
            tok = trainer.processing_class
            return {"prompt_ids": ids, "logprobs": None,
                    "completion_ids": for_trl(ids, trainer.state.global_step + 1, len(tok), tok.eos_token_id)}
        trainer = GRPOTrainer(model=model, reward_funcs=[vowels, brevity], args=GRPOConfig(**common),
                              train_dataset=data, rollout_func=rollout, peft_config=peft_config)
    else:
        class Fed(RLOOTrainer):  # RLOOTrainer has no rollout_func: its one generation method, replaced
            def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
                tok = self.processing_class
                return for_trl(prompt_ids, self.state.global_step + 1, len(tok), tok.eos_token_id)
        trainer = Fed(model=model, reward_funcs=[vowels, brevity], args=RLOOConfig(**common), train_dataset=data,
                      peft_config=peft_config)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]


CASES = {  # id: (algorithm, loss_type, beta, LoRA); dr_grpo with its paper's unscaled advantages, bnpo with the
    # std of the whole batch (over both ranks: TRL's gathers every reward), grpo with truncated completions masked;
    # ZeRO-3 unless STAGES says otherwise
    "dapo": ("grpo", "dapo", 0.0, False), "grpo": ("grpo", "grpo", 0.0, False),
    "dr_grpo": ("grpo", "dr_grpo", 0.0, False), "bnpo": ("grpo", "bnpo", 0.0, False),
    "rloo": ("rloo", None, 0.0, False),
    # a KL to the reference (a frozen copy of the starting weights, partitioned like the policy), and two updates
    # per rollout batch (rl.num_iterations 2: the second against the sampling policy's log-probs), 4 steps
    "dapo-kl-2it": ("grpo", "dapo", 0.5, False), "rloo-kl-2it": ("rloo", None, 0.5, False),
    # LoRA: the reference is the policy with its adapters switched off, as TRL's with peft
    "grpo-kl-lora": ("grpo", "grpo", 0.5, True),
}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
STAGES = {"grpo": "zero0.json", "dr_grpo": "zero1.json", "rloo": "zero2_offload.json"}  # every stage, once


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_trl(tmp_path, cache, tiny_llama, prompts_file, case):
    algorithm, loss_type, beta, lora = CASES[case]
    iterations = 2 if case.endswith("-2it") else 1
    steps = STEPS + 1 if iterations > 1 else STEPS
    scale = {"dr_grpo": "none", "bnpo": "batch"}.get(case, "group")
    extra = [f"--rl.algorithm={algorithm}", f"--rl.beta={beta}", f"--rl.num_iterations={iterations}"] + (
        [f"--rl.loss_type={loss_type}", f"--rl.scale_rewards={scale}"] if loss_type else []) + (
        [f"--lora.r={LORA['r']}", f"--lora.alpha={LORA['lora_alpha']}", "--train.lr=1e-2"] if lora else [])
    masked = case == "grpo"  # completions cut at max_completion_length add no loss (TRL's option)
    extra += ["--rl.mask_truncated_completions=true"] if masked else []
    got = ours(tmp_path, cache, tiny_llama, prompts_file, extra, STAGES.get(case, "zero3.json"), steps)
    config = {"loss_type": loss_type, "scale_rewards": scale} if loss_type else {}
    config |= {"mask_truncated_completions": True} if masked else {}
    if lora:
        from peft import LoraConfig
        config |= {"peft_config": LoraConfig(**LORA), "learning_rate": 1e-2}
    want = theirs(tmp_path, tiny_llama, algorithm, beta, steps=steps, num_iterations=iterations, **config)
    assert len(got) == len(want) == steps
    compared = COMPARED + (["kl"] if beta else [])
    for name in compared:
        print(f"{case} {name}: ours {[r.get(name) for r in got]}\n{' ' * len(name)}  TRL  "
              f"{[r.get(name) for r in want]}")
    for step, (a, b) in enumerate(zip(got, want), start=1):
        rollout = (step - 1) % iterations == 0  # TRL logs the reward and length figures at its rollouts only
        for name in compared:
            if name in b or rollout:
                assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (step, name)
    assert got[-1]["grad_norm"] != pytest.approx(got[0]["grad_norm"], rel=1e-3)  # the updates changed the weights
    if beta:
        # the policy left the reference (RLOO's first-order estimate can be negative)
        assert got[0]["kl"] == pytest.approx(0.0, abs=1e-6) and abs(got[-1]["kl"]) > 1e-4


def test_distillation_under_zero3_equals_a_plain_loop_with_trls_gkd_loss(tmp_path, cache, tiny_llama,
                                                                          tiny_llama_mha, prompts_file):
    """rl.teacher alone (no rewards), distill_beta 0.5 (the JSD between the two): a 2-rank ZeRO-3 run (student and
    teacher partitioned) against a plain single-process loop that runs each prompt + completion unpadded through
    both models and scores it with TRL's GKDTrainer.generalized_jsd_loss (an implementation of its own, not the
    DeepSpeed one the run uses), mean over the batch's completion tokens, torch AdamW. Per-step loss and pre-clip
    gradient norm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDTrainer

    beta = 0.5
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero3.json", *PARTITIONED, f"--model.name_or_path={tiny_llama}",
            f"--data.path={prompts_file}", "--data.format=prompt", "--data.val_fraction=0", "--output_dir", str(run),
            f"--rl.teacher={tiny_llama_mha}", f"--rl.distill_beta={beta}",
            "--rl.rollout_engine=tests/fed_rollouts.py:Fed", f"--rl.num_generations={G}",
            f"--rl.max_completion_length={fed_rollouts.MAX_LEN}", f"--rl.temperature={TEMPERATURE}",
            f"--train.max_steps={STEPS}", f"--train.lr={LR}", "--train.warmup_steps=0", "--train.min_lr_ratio=1.0",
            "--train.weight_decay=0.0", "--train.precision=fp32", "--train.micro_batch_size=2",
            "--train.seq_len=48", "--eval.every=0", "--log.wandb=false", "--log.progress_bar=false",
            "--checkpoint.every=0", "--checkpoint.export_hf=false"], cache)
    got = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert_summary_leads_with(proc.stderr, run, "distillation KL", f"{got[0]['distill_loss']:.4f} (step 1) -> "
                              f"{got[-1]['distill_loss']:.4f} (step {STEPS})")

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    student = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama_mha, dtype=torch.float32).eval()
    opt = torch.optim.AdamW(student.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    want = []
    for step in range(1, STEPS + 1):
        total, tokens = 0.0, 0
        losses = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            for c in range(G):
                completion = fed_rollouts.completion(ids, c, step, len(tokenizer), tokenizer.eos_token_id)
                seq = torch.tensor([ids + completion])
                keep = slice(len(ids) - 1, seq.shape[1] - 1)  # the logits that predict the completion
                s_logits = student(input_ids=seq).logits[:, keep]
                with torch.no_grad():
                    t_logits = teacher(input_ids=seq).logits[:, keep]
                labels = torch.tensor([completion])
                loss = GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels, beta=beta, temperature=TEMPERATURE,
                                                       reduction="sum")
                losses.append(loss)
                tokens += len(completion)
        total = torch.stack(losses).sum() / tokens
        opt.zero_grad()
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        want.append({"loss": total.item(), "grad_norm": norm.item()})
    print(f"distillation: ours {[(r['loss'], r['grad_norm']) for r in got]}\n  loop {want}")
    assert len(got) == STEPS
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["distill_loss"] == a["loss"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert "reward" not in got[0]  # nothing to report without reward functions


def test_a_reward_function_that_fails_mid_run_is_one_line_and_keeps_the_last_good_checkpoint(
        tmp_path, cache, tiny_llama, prompts_file):
    """A user's reward function raising from its third call on (step 3), on the rank that has the prompt 'Sam', of a
    2-rank run that checkpoints every 2 steps in the background: exit code 2, one `error:` line naming the
    function, the exception and the completion, no traceback, and the step-2 checkpoint (in flight when step 3
    failed) finished and the newest. Before, the failing rank's line was never said and the save was lost.
    Issue 69, as a new user ran it: one function named as TRL takes it (`--rl.reward_funcs=flaky.py:flaky`, refused
    as 'should be of type list'), the progress bar up (the error line was glued to it), and the error line the last
    of stderr (c10d's 19-frame 'recvValue failed' dump of the rank still polling rank 0's store followed it in 10 of
    24 failed launches; 4 of 6 of this machine's launches of a bad data.path before the fix)."""
    flaky = tmp_path / "flaky.py"
    flaky.write_text("calls = 0\n\n\ndef flaky(prompts, completions, **kw):\n    global calls\n    calls += 1\n"
                     "    if calls >= 3 and any('Sam' in p for p in prompts):\n        raise ValueError('no score for this')\n"
                     "    return [float(len(c)) for c in completions]\n")
    run = tmp_path / "run"
    proc = launch(["--ds_config", "zero2.json", f"--model.name_or_path={tiny_llama}", f"--data.path={prompts_file}",
                   "--data.format=prompt", "--data.val_fraction=0", "--output_dir", str(run),
                   f"--rl.reward_funcs={flaky}:flaky", "--rl.rollout_engine=tests/fed_rollouts.py:Fed",
                   f"--rl.num_generations={G}", f"--rl.max_completion_length={fed_rollouts.MAX_LEN}",
                   "--train.max_steps=4", "--train.micro_batch_size=2", "--train.seq_len=48", "--eval.every=0",
                   "--log.wandb=false", "--log.progress_bar=true", "--checkpoint.every=2",
                   "--checkpoint.export_hf=false"], cache, launcher="warm", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "reward function flaky raised ValueError: no score for this on completion" in \
        errors[0], proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    assert "recvValue failed" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr[-3000:]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert checkpoints == ["step_00000002"] and (run / "checkpoints/step_00000002/complete.json").exists()
