"""Every user mistake: exit code 2, exactly one line on stderr naming the problem and the fix, no traceback,
and an existing run's checkpoints and export untouched."""
import hashlib
import json
from pathlib import Path

import pytest

from tests.helpers import launch

QUICK = ["--train.max_steps=2", "--train.warmup_steps=1", "--train.micro_batch_size=2", "--train.seq_len=32",
         "--eval.max_batches=1", "--log.wandb=false", "--log.progress_bar=false"]


def fails(args, cache, tmp_path, expected: str, launcher: str = "warm-python", **env):
    fresh = not (tmp_path / "run").exists()
    proc = launch(QUICK + ["--output_dir", str(tmp_path / "run")] + args, cache, launcher=launcher, check=False,
                  HF_HUB_OFFLINE="1", **env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]
    # issue 69: under the deepspeed runner c10d's 19-frame 'recvValue failed' dump of a rank still polling rank 0's
    # store followed the error line in 4 of 6 launches here; the line is the last a person reads
    assert "recvValue failed" not in proc.stderr and proc.stderr.strip().splitlines()[-1] == lines[0], \
        proc.stderr[-3000:]
    if fresh and "--output_dir" not in args:  # issue 29 item 7: bad input left an empty run directory behind
        assert not (tmp_path / "run").exists(), "a refused run left its run directory behind"
    return lines[0]


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    from transformers import T5Config
    out = tmp_path_factory.mktemp("t5")
    T5Config(vocab_size=576, d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "body.jsonl").write_text("".join(json.dumps({"body": "Mira had two keys. " * 5}) + "\n" for _ in range(50)))
    (d / "empty.jsonl").write_text("")
    (d / "bad_batch.json").write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 1}}))
    (d / "a_file").write_text("")
    (d / "bad_line.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three\n{"text": "four"}\n')
    (d / "bad.yaml").write_text("model:\n  name_or_path: recipes/tiny/model\ntrain:\n  max_steps: [3\n")
    (d / "no_reply.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Hi there."}]})
                                              + "\n" for _ in range(40)))
    return d


CASES = {
    "missing recipe": (["--recipe", "recipes/nope.yaml"], "recipe 'recipes/nope.yaml' not found"),
    "unknown key": (["--train.max_step=3"], "unknown recipe key 'train.max_step' (did you mean 'max_steps'?)"),
    "misspelled ds key": (["--ds.zero_optimization.overlap_com=true"], "did you mean 'overlap_comm'?"),
    "missing ds config": (["--ds_config", "zero9.json"], "DeepSpeed config 'zero9.json' not found"),
    "fp16 on cpu": (["--ds_config", "zero2_fp16.json"], "fp16 is not supported on this device (cpu)"),
    "zero++ on cpu": (["--ds_config", "zero3_zeropp.json"], "ZeRO++ (zero_optimization.zero_quantized_weights, "
                      "zero_optimization.zero_quantized_gradients) needs CUDA GPUs; this device is cpu"),
    "compression with zero2": (["--ds_config", "zero2.json", "--compression.method=powersgd"],
                               "compression.method=powersgd works with ZeRO stage 0 or 1, but this config uses ZeRO-2"),
    # seq_len too long, an unreachable hub id, data and model mistakes: on an existing run, further down
    "resume path not a checkpoint": (["--resume", "/tmp"], "--resume /tmp: not a complete checkpoint"),
    # issue 16: an AssertionError traceback from deepspeed.initialize; a hub hint for a mistyped local path
    "sequence parallel": (["--ds.sequence_parallel_size=2"], "world size 1 is not divisible by pipeline stages (1) x "
                          "tensor-parallel size (1) x sequence-parallel size (2)"),
    "plan with sequence parallelism": (["--plan", "--ds_config", "sp2_zero3.json"], "--plan does not model sequence "
                                       "parallelism yet"),
    # issue 59: DeepSpeed's ZeRO-1/2/3 clip Muon's orthogonalised update (the step divided by its norm, silently)
    "muon with clipping": (["--train.optimizer=muon", "--train.max_grad_norm=1.0"], "gradient clipping (1) with "
                           "Muon under ZeRO-2: DeepSpeed 0.19.8 clips Muon's orthogonalised update"),
    "plan with muon": (["--plan", "--train.optimizer=muon"], "--plan does not model Muon yet"),
    # issue 71: AutoEP on a dense model warned and trained every weight on every rank
    "expert parallelism on a dense model": (["--ds_config", "ep2_zero2.json"], "expert_parallel.autoep_size=2 but "
                                            "the model has no routed experts"),
    # gpt-oss has no AutoEP preset: DeepSpeed warned, found 0 MoE layers and trained every expert on every rank
    "expert parallelism AutoEP would not find": (["--ds_config", "ep2_zero2.json", "--model.name_or_path={gpt_oss}",
                                                  "--model.tokenizer=recipes/tiny/model"],
                                                 "DeepSpeed's AutoEP has no preset for model type 'gpt_oss'"),
    "muon beside expert parallelism": (["--recipe", "tiny/moe", "--train.optimizer=muon", "--train.max_grad_norm=0"],
                                       "expert_parallel with train.optimizer=muon is not supported yet"),
    "plan with expert parallelism": (["--plan", "--recipe", "tiny/moe"], "--plan does not model expert parallelism "
                                     "yet (expert_parallel.autoep_size=2)"),
    "simulate with expert parallelism": (["--plan", "--simulate", "--device", "h100-80gb", "--interconnect",
                                          "ib-ndr", "--recipe", "tiny/moe"], "--simulate does not model expert "
                                         "parallelism yet"),
    "missing local model": (["--model.name_or_path=./no/such/model"], "cannot load './no/such/model': no such "
                            "directory"),
    "learning_rate": (["--train.learning_rate=1e-4"], "(here it is 'train.lr')"),
    # issue 16: crashed with an IndexError inside datasets.load_from_disk
    "chat data all longer than seq_len": (["--recipe", "tiny/chat_sft", "--train.seq_len=8"],
                                          "gives no training sequences of length 8: all"),
    # issue 31: preference training's mistakes
    "preference keys with text data": (["--preference.beta=0.2"], "preference.* keys are set but data.format=text"),
    "pairs without chosen": (["--data.path=data/tiny_sft", "--data.format=preference", "--preference.loss=orpo"],
                             "dataset 'data/tiny_sft' has no field 'chosen'"),
    "dpo from random weights": (["--data.path=data/tiny_dpo", "--data.format=preference"],
                                "preference.loss=dpo needs a trained model as its reference"),
}


@pytest.mark.parametrize("name", CASES)
def test_simple_mistakes(name, cache, tmp_path):
    args, expected = CASES[name]
    if name == "fp16 on cpu":
        from dstrain.parallel.ds_config import DeviceCaps
        if DeviceCaps.detect().fp16:  # DeepSpeed's CPU accelerator says yes where oneDNN has fp16 (AVX512-FP16/AMX)
            pytest.skip("this CPU runs fp16 (DeepSpeed's accelerator reports it), so fp16 is no mistake here; "
                        "tests/unit/test_ds_config.py checks the refusal on a CPU without it")
    if "{gpt_oss}" in " ".join(args):  # a config only (from_scratch=auto): what AutoEP is given is the model type
        from transformers import AutoConfig
        AutoConfig.for_model("gpt_oss", vocab_size=576, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                             num_experts_per_tok=2).save_pretrained(tmp_path / "gpt_oss")
        args = [a.replace("{gpt_oss}", str(tmp_path / "gpt_oss")) for a in args]
    fails(args, cache, tmp_path, expected)


def _everything(run: Path) -> dict:
    """Every path in the run directory with its bytes' digest (directories: None)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(run.rglob("*")) if p.name != ".lock"}


@pytest.mark.parametrize("launcher", ["warm-python", "deepspeed"])
def test_a_bad_deepspeed_value_leaves_an_existing_run_untouched(cache, tmp_path, two_rank_run, launcher):
    """Issue 29 item 4: --ds.zero_optimization.stage=4 on an existing 2-rank run rewrote recipe.yaml,
    ds_config.json and run_info.json, made step_N.universal/ and stacks/, printed pydantic's traceback and exited
    1 (which launch/ scripts retry). Both fp16 and bf16 enabled trained silently in one of them. DeepSpeed's own
    models now check the values in the validation pass: exit 2, one line, nothing written."""
    run = two_rank_run
    before = _everything(run)
    for args, expected in ((["--ds.zero_optimization.stage=4"], "zero_optimization.stage=4 is not valid: Input "
                             "should be 0, 1, 2, 3"),
                           (["--ds.zero_optimization.offload_optimizer.device=gpu"],
                            "zero_optimization.offload_optimizer.device='gpu' is not valid"),
                           (["--ds.fp16.enabled=true", "--ds.bf16.enabled=true"], "enables both fp16 and bf16")):
        fails(args + ["--output_dir", str(run)], cache, tmp_path, expected, launcher=launcher)
        assert _everything(run) == before, f"{args} changed the run directory"
        if launcher == "deepspeed":  # under the launcher (2 ranks) once is enough: the check is the same
            break


def test_a_busy_master_port_is_one_line(cache, tmp_path):
    """Issue 16: a busy rendezvous port gave a DistNetworkError traceback."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        fails([], cache, tmp_path, f"port {port} on 127.0.0.1 is already in use", MASTER_ADDR="127.0.0.1",
              MASTER_PORT=str(port))


def test_data_and_model_mistakes(cache, tmp_path, data_files):
    """The data and model mistakes that need an existing run to matter are in
    test_a_failed_run_on_another_world_size_converts_nothing; these two need no run."""
    fails(["--ds_config", str(data_files / "bad_batch.json")], cache, tmp_path,
          "train_batch_size=64 but micro_batch_size 2 x grad_accum_steps 1 x data-parallel world 1 = 2")
    fails(["--output_dir", str(data_files / "a_file" / "run")], cache, tmp_path, "cannot write to output_dir")
    # issue 29 item 7: no line numbers, and a hint that pointed at data.path for a malformed line
    fails([f"--data.path={data_files / 'bad_line.jsonl'}"], cache, tmp_path,
          f"dataset file {data_files / 'bad_line.jsonl'} line 3 is not valid JSON")
    fails(["--recipe", str(data_files / "bad.yaml")], cache, tmp_path, "is not valid YAML (line 5, column 1)")
    # issue 29 item 7: the offline --preflight of a hub recipe did not say that a config alone is enough
    fails(["--preflight", "--recipe", "llama-3.2-1b/sft.yaml"], cache, tmp_path,
          "`hf download meta-llama/Llama-3.2-1B-Instruct --local-dir DIR` where it is reachable (--preflight "
          "needs only config.json)")
    # issue 29 item 7: chat data without an assistant turn was told to raise train.seq_len (also at 512)
    line = fails(["--recipe", "tiny/chat_sft", f"--data.path={data_files / 'no_reply.jsonl'}",
                  "--train.seq_len=512"], cache, tmp_path, "has a reply to learn from")
    assert "seq_len" not in line.split(":", 2)[-1], line


def _digest(run: Path) -> dict:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for sub in ("checkpoints", "hf") for p in sorted((run / sub).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, cache) -> Path:
    """A finished 2-rank run (ZeRO-2 partitions: another world size needs a universal conversion), with hf/."""
    run = tmp_path_factory.mktemp("existing") / "run"
    launch(QUICK + ["--output_dir", str(run)], cache)
    return run


def test_failed_runs_leave_existing_checkpoints_and_export_intact(cache, tmp_path, two_rank_run):
    run = two_rank_run
    before, lock = _digest(run), (run / ".lock").read_text()
    assert any(k.startswith("hf/") for k in before) and any(k.startswith("checkpoints/") for k in before)
    fails(["--resume", "never", "--output_dir", str(run)], cache, tmp_path,
          "already holds checkpoints and --resume never would overwrite")
    # a step more than the finished run had (else it is finished: test_a_finished_run_started_again_stays_as_it_was)
    proc = launch(QUICK + ["--output_dir", str(run), "--train.micro_batch_size=4", "--train.max_steps=3"], cache,
                  check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "trained with a global batch of 4 samples, this run has 8" in errors[0]
    assert "recvValue failed" not in proc.stderr and proc.stderr.strip().splitlines()[-1] == errors[0]
    assert _digest(run) == before
    assert (run / ".lock").read_text() == lock  # issue 85: a refused launch rewrote it with its own pid


def test_a_finished_run_started_again_stays_as_it_was(cache, tmp_path, two_rank_run):
    """Issue 85: the same command again on a finished run (a requeued job, a second look) rewrote its recipe.yaml,
    ds_config.json, summary.json (tokens/s and MFU null) and model_config/. Now: one line, exit 0, every file as it
    was (the run lock's too: it names the run that trained there)."""
    run = two_rank_run
    files = {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    proc = launch(QUICK + ["--output_dir", str(run)], cache, launcher="warm-python", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"{run} holds this run finished at step 2 (train.max_steps=2); "
                                                     "nothing to do: raise train.max_steps to train on, or give "
                                                     "another --output_dir"), proc.stderr[-3000:]
    after = {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert after.keys() == files.keys() and all(after[k] == files[k] for k in files), \
        [k for k in files if after.get(k) != files[k]]


def test_a_failed_run_on_another_world_size_converts_nothing(cache, tmp_path, data_files, t5_dir, two_rank_run):
    """Issue 15's bug: on a 2-rank run's directory, a 1-rank run with bad input first wrote a universal
    conversion (~150 files) into checkpoints/step_N/, then failed. Every input is now checked first, and a
    conversion, when one happens, goes beside the checkpoint (step_N.universal), never into it."""
    run = two_rank_run
    before = _digest(run)
    for args, expected in (
            ([f"--data.path={data_files / 'body.jsonl'}"],
             "has no field 'text' (columns: body); set data.text_field to one of them"),
            ([f"--data.path={data_files / 'empty.jsonl'}"], "is empty"),
            ([f"--data.path={data_files / 'missing.jsonl'}"], "missing.jsonl"),
            (["--train.seq_len=4096"], "train.seq_len=4096 exceeds the model's maximum positions (512)"),
            ([f"--model.name_or_path={t5_dir}"], "is a t5 model, which has no causal-LM head"),
            (["--model.name_or_path=some-org/not-cached-model"], "cannot load 'some-org/not-cached-model'")):
        fails(args + ["--output_dir", str(run)], cache, tmp_path, expected)
        assert _digest(run) == before, f"{args} changed the run directory"
    proc = launch(QUICK + ["--output_dir", str(run), "--train.max_steps=3"], cache,
                  launcher="warm-python")  # good input: converts, resumes (one step more: a finished run does nothing)
    assert "converting" in proc.stderr and "resumed from" in proc.stderr, proc.stderr[-3000:]
    after = _digest(run)
    # the step trained adds a checkpoint (and points `latest` at it) and exports again; step 2's files are as they were
    kept = {k: v for k, v in before.items() if k.startswith("checkpoints/step_")}
    assert {k: after.get(k) for k in kept} == kept
    assert any(".universal/" in k for k in after) and any("step_00000003/" in k for k in after)


def test_an_unreachable_hub_fails_at_once_in_a_short_line(cache, tmp_path):
    """Issue 54 item 8: the README's --preflight example spent 25 s in the Hub client's retries before its error, a
    434-character line. Run as written (no HF_HUB_OFFLINE): one probe of the Hub, then offline mode."""
    import time

    from dstrain.hub import hub_reachable
    from tests.helpers import readme_command
    if hub_reachable():
        pytest.skip("the Hugging Face Hub is reachable from here: nothing to fail")
    argv = readme_command("--preflight")
    began = time.monotonic()
    proc = launch(argv, cache, launcher="python", check=False)
    took = time.monotonic() - began
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the Hugging Face Hub is offline here and it is not cached" in lines[0] and len(lines[0]) <= 250, lines
    assert took < 15, f"{took:.1f} s before the error"  # python and the imports: ~5 s; the retries were 25 s more


def test_a_state_space_hybrid_is_refused_packing(tmp_path, cache, tiny_bamba):
    """Issue 85: Bamba packed SFT trained with exit 0 while its Mamba-2 state crossed from one example into the next
    ("attention kept within each document"); the layout check refuses it before anything is built."""
    line = fails([f"--model.name_or_path={tiny_bamba}", "--data.path=data/tiny_sft", "--data.format=prompt_response",
                  "--data.packing=true"], cache, tmp_path,
                 "data.packing with bamba: layer 0's mamba (BambaMixer) moves information between packed documents")
    assert line.endswith("set data.packing=false")
