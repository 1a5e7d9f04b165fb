"""Preference training against TRL's own code (the reference a user would otherwise run): the loss, rewards and
gradients of one batch through TRL's DPOTrainer, CPOTrainer (SimPO) and ORPOTrainer, and the data format's prompt
extraction and tokenization against TRL's."""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain.config import DataConfig, PreferenceSection
from dstrain.data.formats import preference as fmt
from dstrain.objectives.preference import Preference, pair_losses

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "recipes/tiny/model"
trl = pytest.importorskip("trl")

PAIRS = [{"prompt": "What is 5 plus 6?", "chosen": " 5 plus 6 is 11.", "rejected": " 5 plus 6 is 6."},
         {"prompt": "Write 7 in words.", "chosen": " 7 is seven.", "rejected": " 7 is fourteen, or so I think."},
         {"prompt": "Tom has five cards and finds one more. How many cards does Tom have?",
          "chosen": " Tom has six cards.", "rejected": " Tom has sixteen cards."}]


@pytest.fixture
def tiny():  # fresh per test: TRL's trainer takes the models over (wraps, patches their forward)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL)).float()
    reference = copy.deepcopy(policy).eval()  # as TRL runs its reference (and our reference pass: engine.eval())
    with torch.no_grad():  # the policy a few steps away from the reference: rewards are not all zero
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, reference, AutoTokenizer.from_pretrained(MODEL)


def ours(cfg: PreferenceSection, policy, reference, tokenizer, seq_len: int = 48, chunk: int = 0,
         packed: bool = False):
    """Our loss (mean over pairs), metrics and the policy's gradients on PAIRS; `chunk`: through the chunked head
    (train.loss_chunk_tokens), `packed`: the pairs' sequences in one row without padding (data.packing)."""
    from datasets import Dataset
    data, _ = fmt.tokenize(Dataset.from_list(PAIRS), DataConfig(format="preference"), tokenizer, seq_len, None)
    batch = {k: torch.tensor(data[k]) for k in data.column_names}
    if chunk:
        from dstrain.components import chunked_loss
        chunked_loss.install(policy, chunk, "fp32")
    objective = Preference(cfg)
    objective.packed = packed
    totals = {k: float(v) for k, v in objective.counts(batch).items()}
    if cfg.needs_reference:
        with torch.no_grad():
            from dstrain.objectives.preference import sequence_logps
            batch["ref_logps"] = sequence_logps(reference, batch)[0].view(2, -1).t()
    policy.zero_grad()
    summed, stats = objective.loss_sum(policy, batch, totals)
    loss = summed / totals["pairs"]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return loss.detach(), objective.metrics(stats.tolist(), totals), grads


def trl_dpo(loss_type: str, beta: float, ls: float, policy, reference, tokenizer):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    args = DPOConfig(output_dir="/tmp/dstrain-trl", per_device_train_batch_size=len(PAIRS), report_to=[],
                     loss_type=[loss_type], beta=beta, label_smoothing=ls, use_cpu=True, max_length=None,
                     disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(PAIRS),
                             processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    policy.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return loss.detach(), {k: v[-1] for k, v in trainer._metrics["train"].items()}, grads, batch["input_ids"].shape[1]


@pytest.mark.parametrize("loss_type,ours_name,ls,chunk,packed", [
    ("sigmoid", "dpo", 0.0, 0, False), ("ipo", "ipo", 0.0, 0, False), ("hinge", "hinge", 0.0, 0, False),
    ("robust", "robust", 0.2, 0, False),
    ("sigmoid", "dpo", 0.0, 7, False), ("sigmoid", "dpo", 0.0, 0, True), ("ipo", "ipo", 0.0, 5, True)],
    ids=["dpo", "ipo", "hinge", "robust", "dpo-chunked-head", "dpo-packed", "ipo-chunked-packed"])
def test_dpo_losses_match_trl_dpotrainer(tiny, loss_type, ours_name, ls, chunk, packed):
    """One batch through TRL's DPOTrainer.compute_loss (its collator, its reference model) and through ours: the
    loss, the logged rewards and log-probs, and every parameter's gradient agree. Also through the chunked head
    (7 and 5 rows of logits at a time: the per-token gradients are formed chunk by chunk in backward) and with the
    pairs packed in one row (the padding-free mode): the same figures as TRL's padded batch."""
    policy, reference, tokenizer = tiny
    beta = 0.1 if loss_type != "ipo" else 0.5
    want_loss, want, want_grads, length = trl_dpo(loss_type, beta, ls, policy, reference, tokenizer)
    # padded as TRL pads (to the longest pair): CPU attention kernels round differently at other lengths (1e-5)
    got_loss, got, got_grads = ours(PreferenceSection(loss=ours_name, beta=beta, label_smoothing=ls), policy,
                                    reference, tokenizer, seq_len=length, chunk=chunk, packed=packed)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert want["rewards/margins"] != 0  # the check has something to see
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sigmoid_with_label_smoothing_is_trls_conservative_dpo():
    """cDPO: TRL's CPO sigmoid (label-smoothed) applied to the log-ratios is conservative DPO."""
    from trl.experimental.cpo import CPOTrainer
    torch.manual_seed(1)
    pc, pr, rc, rr = (torch.randn(6) * 5 - 20 for _ in range(4))
    n = torch.full((6,), 5)
    fake = SimpleNamespace(alpha=0.0, beta=0.3, label_smoothing=0.15, loss_type="sigmoid",
                           accelerator=SimpleNamespace(device="cpu"))
    want = CPOTrainer.cpo_loss(fake, pc - rc, pr - rr)[0]
    got = pair_losses(PreferenceSection(loss="dpo", beta=0.3, label_smoothing=0.15), pc, pr, n, n, rc, rr)[0]
    torch.testing.assert_close(got, want)


def test_simpo_matches_trls_cpo_trainer():
    from trl.experimental.cpo import CPOTrainer
    torch.manual_seed(2)
    pc, pr = torch.randn(6) * 5 - 20, torch.randn(6) * 5 - 25
    nc, nr = torch.randint(3, 9, (6,)), torch.randint(3, 9, (6,))
    fake = SimpleNamespace(alpha=0.0, beta=2.0, label_smoothing=0.1, loss_type="simpo", simpo_gamma=0.5,
                           accelerator=SimpleNamespace(device="cpu"))
    want, want_c, want_r = CPOTrainer.cpo_loss(fake, pc / nc, pr / nr)  # CPO averages per token for simpo
    got, got_c, got_r, _, _ = pair_losses(PreferenceSection(loss="simpo", beta=2.0, label_smoothing=0.1), pc, pr,
                                          nc, nr, None, None)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_c, want_c)
    torch.testing.assert_close(got_r, want_r)


def test_orpo_matches_trls_orpo_trainer(tiny):
    """The odds-ratio term against ORPOTrainer.odds_ratio_loss; the whole ORPO loss (with its NLL over the chosen
    sequences) against ORPOTrainer's formula, on the tiny model."""
    from trl.experimental.orpo import ORPOTrainer
    torch.manual_seed(3)
    pc, pr = torch.randn(6) - 4, torch.randn(6) - 6
    n = torch.ones(6, dtype=torch.long)
    fake = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device="cpu"))
    want, want_c, want_r, _, _ = ORPOTrainer.odds_ratio_loss(fake, pc, pr)
    got, got_c, got_r, _, _ = pair_losses(PreferenceSection(loss="orpo", beta=0.25), pc, pr, n, n, None, None)
    torch.testing.assert_close(got, -want)  # TRL subtracts its `losses` from the NLL
    torch.testing.assert_close(got_c, want_c)
    torch.testing.assert_close(got_r, want_r)
    policy, _, tokenizer = tiny
    loss, metrics, grads = ours(PreferenceSection(loss="orpo", beta=0.25), policy, None, tokenizer)
    # the chunked head and packed pairs compute the same ORPO loss and gradients (NLL term included)
    loss_cp, _, grads_cp = ours(PreferenceSection(loss="orpo", beta=0.25), copy.deepcopy(policy), None, tokenizer,
                                chunk=6, packed=True)
    torch.testing.assert_close(loss_cp, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_cp[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    from datasets import Dataset
    data, _ = fmt.tokenize(Dataset.from_list(PAIRS), DataConfig(format="preference"), tokenizer, 48, None)
    b = {k: torch.tensor(data[k]) for k in data.column_names}
    with torch.no_grad():  # ORPOTrainer's NLL: cross-entropy mean over the chosen rows' non-padding tokens
        logits = policy(input_ids=b["chosen_input_ids"], attention_mask=b["chosen_attention_mask"]).logits
        labels = b["chosen_input_ids"].masked_fill(b["chosen_attention_mask"] == 0, -100)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        from dstrain.objectives.preference import sequence_logps
        logps, lengths, _ = sequence_logps(policy, b)
        odds = ORPOTrainer.odds_ratio_loss(fake, *(logps / lengths).chunk(2))[0]
    torch.testing.assert_close(loss, nll - odds.mean(), rtol=1e-5, atol=1e-6)
    # issue 54 item 10: TRL's ORPO metrics, logged under its names
    _, _, _, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(fake, *(logps / lengths).chunk(2))
    assert metrics["nll_loss"] == pytest.approx(float(nll), rel=1e-5)
    assert metrics["log_odds_ratio"] == pytest.approx(float(log_odds_ratio), rel=1e-5)
    assert metrics["log_odds_chosen"] == pytest.approx(float(log_odds_chosen), rel=1e-5)


@pytest.mark.parametrize("conversational", [False, True])
def test_tokenized_pairs_match_trls(tiny, conversational):
    """Prompt and response token ids as TRL's DPOTrainer makes them: strings (EOS appended) and conversations with
    an implicit prompt (extract_prompt), rendered with the tokenizer's chat template."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    policy, reference, tokenizer = tiny
    if conversational:
        rows = [{"chosen": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}],
                 "rejected": [{"role": "user", "content": p["prompt"]},
                              {"role": "assistant", "content": p["rejected"]}]} for p in PAIRS]
    else:
        rows = PAIRS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=policy, ref_model=reference, processing_class=tokenizer,
                             args=DPOConfig(output_dir="/tmp/dstrain-trl", report_to=[], use_cpu=True, max_length=None),
                             train_dataset=Dataset.from_list(json.loads(json.dumps(rows))))
    for row, theirs in zip(rows, trainer.train_dataset):
        prompt, chosen, rejected = fmt.pair_tokens(dict(row), DataConfig(format="preference"), tokenizer)
        assert (prompt, chosen, rejected) == (theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"])


def test_implicit_prompt_is_trls_extract_prompt():
    from trl.data_utils import extract_prompt
    for chosen, rejected in (("Q: sky? It is blue.", "Q: sky? It is green."), ("abc", "abd"), ("same", "same!"),
                             ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
                              [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}])):
        want = extract_prompt({"chosen": chosen, "rejected": rejected})
        assert fmt.extract_prompt(chosen, rejected) == (want["prompt"], want["chosen"], want["rejected"])


def test_long_pairs_lose_the_prompt_start_then_the_response_ends():
    prompt, chosen, rejected = list(range(30)), list(range(100, 120)), list(range(200, 205))
    p, c, r, cut = fmt.fit(prompt, chosen, rejected, seq_len=32, max_prompt=16)
    assert cut and p == prompt[-16:] and c == chosen[:16] and r == rejected
    assert fmt.fit(prompt[:4], chosen[:4], rejected, 32, 16)[3] is False


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    from transformers import LlamaConfig
    path = tmp_path_factory.mktemp("8b")
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0).save_pretrained(path)
    return path


def test_shipped_dpo_recipes_fit_where_they_say_and_count_two_rows_a_pair(llama_8b):
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.parallel import ds_config as dsc
    from dstrain.planner import memory
    gpu = dsc.DeviceCaps("cuda", bf16=True, fp16=True)
    for name in ("llama-3.1-8b/dpo_zero3.yaml", "llama-3.1-8b/dpo_lora.yaml"):
        r = load_recipe(name, parse_overrides([f"--model.name_or_path={llama_8b}",
                                               "--model.tokenizer=recipes/tiny/model"]))
        fits, text = memory.preflight(r, dsc.load(r.ds_config), r.ds_config, 8, 8, gpu,
                                      memory.target_device("h100-80gb", None))
        assert fits, text
        print(text)
        assert f"micro batch {r.train.micro_batch_size} pairs = {2 * r.train.micro_batch_size} rows" in text, text
    # a pair is two rows: the same recipe read as SFT data has half the activations
    pairs = load_recipe("llama-3.1-8b/dpo_zero3.yaml", parse_overrides([f"--model.name_or_path={llama_8b}"]))
    rows = load_recipe("llama-3.1-8b/dpo_zero3.yaml", parse_overrides([f"--model.name_or_path={llama_8b}",
                                                                       "--data.format=chat"]))
    from transformers import AutoConfig

    from dstrain.parallel.layout import Layout
    config = AutoConfig.from_pretrained(llama_8b)
    ds = dsc.resolve(dsc.load("zero3.json"), pairs, 8, gpu, hidden_size=4096)
    layout = Layout.from_ds_config(ds, 8)
    est = [memory.estimate(config, memory.count_parameters(config), r, ds, layout) for r in (pairs, rows)]
    assert est[0].activations_full == pytest.approx(2 * est[1].activations_full, rel=0.01)


def test_what_preference_training_refuses_in_the_validation_pass():
    """Pipeline stages and sequence parallelism are refused in one line each (not yet built); LoRA switches the
    reference to the adapters-off base; the chunked head and packing are taken."""
    from dstrain.components import Setup
    from dstrain.config import load_recipe, parse_overrides
    from dstrain.errors import UserError
    from dstrain.parallel.layout import Layout

    def setup(*overrides, ds=None):
        r = load_recipe("tiny/dpo", parse_overrides(list(overrides)))
        layout = Layout.from_ds_config(ds or {}, 2)
        return Setup(r, layout, {}, "fp32", None, Path("/tmp/x"), None, print)
    cases = [((), {"pipeline": {"stages": 2}}, "does not run on pipeline stages"),
             ((), {"sequence_parallel_size": 2}, "does not run with Ulysses sequence parallelism")]
    for overrides, ds, message in cases:
        with pytest.raises(UserError, match=message):
            Preference(PreferenceSection()).validate(setup(*overrides, ds=ds))
    taken = Preference(PreferenceSection())
    taken.validate(setup("--train.loss_chunk_tokens=1024", "--data.packing=true"))
    assert taken.packed
    lora = Preference(PreferenceSection())
    lora.validate(setup("--lora.r=8"))
    assert lora.adapters_off
    free = Preference(PreferenceSection(loss="simpo"))
    free.validate(setup("--lora.r=8", "--preference.loss=simpo"))
    assert not free.adapters_off  # no reference at all


def test_identical_pairs_are_counted_and_warned():
    from datasets import Dataset
    from transformers import AutoTokenizer

    from dstrain.data import report
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows = PAIRS + [{"prompt": "Say hi.", "chosen": " Hi.", "rejected": " Hi."}]
    data, stats = fmt.tokenize(Dataset.from_list(rows), DataConfig(format="preference"), tokenizer, 48, None)
    assert stats["identical"] == 1 and stats["pairs"] == 4 and len(data) == 4
    assert "warning: 1 pairs have identical chosen and rejected responses" in report(stats, 48)


def test_ties_are_not_accurate_at_step_one_as_in_trl(tiny):
    """Issue 58's audit: counting ties (>=) as accurate passed every test, because no test had a tie. At step 1
    the policy is the reference: every reward is 0, and TRL's rule (DPOTrainer: chosen_rewards > rejected_rewards)
    counts none of them; its step-1 log is 0.0 where exact ties hold (ours; TRL's own forward passes differ by
    ~1e-4 there, so its value is noise and not compared)."""
    _, reference, tokenizer = tiny
    policy = copy.deepcopy(reference)
    got = ours(PreferenceSection(loss="dpo", beta=0.1), policy, reference, tokenizer)[1]
    assert got["rewards/margins"] == 0 and got["rewards/chosen"] == 0
    assert got["rewards/accuracies"] == 0.0
