#!/usr/bin/env python3
"""Generate the tiny corpus, tokenizer and model config the default recipe trains on.

Everything here is deterministic (fixed seeds, single-threaded tokenizer training), so running the
script again reproduces the shipped files byte for byte; `tests/unit/test_assets.py` checks that.

Outputs (all small enough to ship in git):
  data/tiny/train.jsonl, data/tiny/val.jsonl   {"text": ...}          raw-text pretraining
  data/tiny_sft/train.jsonl                    {"prompt", "response"} supervised fine-tuning
  data/tiny_chat/train.jsonl                   {"messages": [...]}    chat-format SFT
  data/tiny_dpo/train.jsonl                    {"prompt", "chosen", "rejected"} preference pairs: a right answer
                                               over a wrong one, or over the same answer said twice
  data/tiny_grpo/train.jsonl                   {"prompt", "answer"} stories up to their count, to learn it from a
                                               reward (tiny/grpo.yaml)
  data/examples/                               the same facts in every layout docs/data.md shows (text, .txt,
                                               prompt/response, Alpaca, OpenAI messages, ShareGPT, TRL's
                                               explicit/implicit/conversational preference and UltraFeedback's,
                                               TRL's prompt-completion plain and conversational, tool calls
                                               with their schemas, reasoning)
  recipes/tiny/model/                          config.json + tokenizer files of a tiny Llama
  recipes/tiny/moe_model/                      config.json of a tiny Mixture-of-Experts model (Mixtral's
                                               architecture, 8 experts, 2 per token; the tokenizer above)
  recipes/tiny/vlm_model/                      a tiny LLaVA's config and processor (the tokenizer above with
                                               <image>), no weights: tiny/vlm_sft.yaml starts from random ones
  data/tiny_vlm/                               {"images", "messages"} in TRL's vision layout, PNG squares whose
                                               colour only the image shows
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' BPE trainer is deterministic single-threaded
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent

NAMES = ["Mira", "Tom", "Ada", "Ravi", "Lena", "Omar", "Yuki", "Sam", "Ines", "Kofi", "Nora", "Ivan"]
ITEMS = ["apples", "pears", "books", "coins", "stones", "shells", "cards", "keys", "cups", "lamps"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "gray"]
PLACES = ["the market", "the river", "the school", "the forest", "the harbor", "the library", "the hill"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "goat", "crow", "frog"]
VERBS_PAST = ["walked to", "ran to", "looked at", "waited near", "painted", "visited"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "foggy"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def _story(rng: random.Random) -> str:
    """A short story whose later sentences follow from earlier ones (counts add up, names recur)."""
    a, b = rng.sample(NAMES, 2)
    item, color, place = rng.choice(ITEMS), rng.choice(COLORS), rng.choice(PLACES)
    n, k = rng.randint(1, 9), rng.randint(1, 9)
    sentences = [
        f"It was a {rng.choice(WEATHER)} day.",
        f"{a} {rng.choice(VERBS_PAST)} {place}.",
        f"{a} had {NUMBER_WORDS[n]} {color} {item}.",
        f"{b} gave {a} {NUMBER_WORDS[k]} more {color} {item}.",
        f"Now {a} has {NUMBER_WORDS[n + k]} {color} {item}.",
    ]
    if rng.random() < 0.5:
        animal = rng.choice(ANIMALS)
        sentences.append(f"A {animal} followed {a} and {b} home from {place}.")
        sentences.append(f"The {animal} was happy.")
    if rng.random() < 0.5:
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        sentences.append(f"{b} said that {x} plus {y} is {x + y}.")
    return " ".join(sentences)


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {x} plus {y}?", f"{x} plus {y} is {x + y}."
    if kind == 1:
        n = rng.randint(0, 17)
        return f"Write {n} in words.", f"{n} is {NUMBER_WORDS[n]}."
    a, item, n = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 9)
    return (f"{a} has {NUMBER_WORDS[n]} {item} and finds one more. How many {item} does {a} have?",
            f"{a} has {NUMBER_WORDS[n + 1]} {item}.")


def _pair(rng: random.Random) -> dict:
    """A question, its right answer (chosen) and a wrong one (rejected): another number, and a hedge a small model
    learns to disprefer within a minute (the number alone takes far longer)."""
    kind = rng.randrange(3)
    if kind == 0:
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        wrong = rng.choice([v for v in range(19) if v != x + y])
        return {"prompt": f"What is {x} plus {y}?", "chosen": f"{x} plus {y} is {x + y}.",
                "rejected": f"{x} plus {y} is {wrong}, I guess."}
    if kind == 1:
        n = rng.randint(0, 17)
        wrong = rng.choice([w for w in NUMBER_WORDS if w != NUMBER_WORDS[n]])
        return {"prompt": f"Write {n} in words.", "chosen": f"{n} is {NUMBER_WORDS[n]}.",
                "rejected": f"{n} is {wrong}, I guess."}
    a, item, n = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 9)
    wrong = rng.choice([w for w in NUMBER_WORDS[1:] if w != NUMBER_WORDS[n + 1]])
    return {"prompt": f"{a} has {NUMBER_WORDS[n]} {item} and finds one more. How many {item} does {a} have?",
            "chosen": f"{a} has {NUMBER_WORDS[n + 1]} {item}.", "rejected": f"{a} has {wrong} {item}, I guess."}


def make_preference(out: Path, n: int, seed: int) -> list[dict]:
    """Its own random stream: the other files (and the tokenizer trained on them) do not change. Every other pair's
    rejected answer is the right one said twice: a pretrained model rates such a repetition likely (it copies), so a
    reference-free loss (SimPO, ORPO) has something to learn from its first step (issue 54: with hedged wrong answers
    alone their reward accuracy was 1.0 before training); DPO measures against the reference and starts at 0."""
    rng = random.Random(seed)
    rows = [_pair(rng) for _ in range(n)]
    for row in rows[1::2]:
        row["rejected"] = f"{row['chosen']} {row['chosen']}"
    _write_jsonl(out / "tiny_dpo/train.jsonl", rows)
    return rows


def make_prompts(out: Path, n: int, seed: int) -> list[dict]:
    """Prompts to learn from rewards (tiny/grpo.yaml): a story up to "Now <name> has", its `answer` the count the
    story's numbers add up to, in words (what the pretraining corpus writes there). Its own random stream."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(NAMES, 2)
        item, color, place = rng.choice(ITEMS), rng.choice(COLORS), rng.choice(PLACES)
        x, y = rng.randint(1, 9), rng.randint(1, 9)
        prompt = (f"It was a {rng.choice(WEATHER)} day. {a} {rng.choice(VERBS_PAST)} {place}. {a} had "
                  f"{NUMBER_WORDS[x]} {color} {item}. {b} gave {a} {NUMBER_WORDS[y]} more {color} {item}. Now {a} has")
        rows.append({"prompt": prompt, "answer": NUMBER_WORDS[x + y]})
    _write_jsonl(out / "tiny_grpo/train.jsonl", rows)
    return rows


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def make_data(out: Path, n_train: int, n_val: int, n_sft: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    train = [{"text": _story(rng)} for _ in range(n_train)]
    val = [{"text": _story(rng)} for _ in range(n_val)]
    qa = [_qa(rng) for _ in range(n_sft)]
    sft = [{"prompt": q, "response": a} for q, a in qa]
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in qa]
    files = {"tiny/train.jsonl": train, "tiny/val.jsonl": val, "tiny_sft/train.jsonl": sft,
             "tiny_chat/train.jsonl": chat}
    for name, rows in files.items():
        _write_jsonl(out / name, rows)
    return files


def _stated_answer(response: str) -> str:
    """The last number (or number word) a response says: `7 is seven.` -> seven, the whole response if none."""
    words = re.findall(r"[A-Za-z]+|\d+", response)
    return next((w for w in reversed(words) if w.isdigit() or w.lower() in NUMBER_WORDS), response)


TOOLS = {"number_to_words": {"type": "function", "function": {
             "name": "number_to_words", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
         "add": {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                              "b": {"type": "integer"}}}}}}


def _tool_conversation(prompt: str, response: str) -> dict:
    """A question, the assistant's tool call, the tool's reply and the answer, the called function's schema in the
    row's `tools` column; a question no tool serves is answered at once, with no schemas."""
    words = re.fullmatch(r"Write (\d+) in words\.", prompt)
    total = re.fullmatch(r"What is (\d+) plus (\d+)\?", prompt)
    messages = [{"role": "user", "content": prompt}]
    if not (words or total):
        return {"messages": messages + [{"role": "assistant", "content": response}], "tools": None}
    name, arguments, result = ("number_to_words", {"n": int(words[1])}, NUMBER_WORDS[int(words[1])]) if words \
        else ("add", {"a": int(total[1]), "b": int(total[2])}, str(int(total[1]) + int(total[2])))
    messages += [{"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "name": name, "content": result}, {"role": "assistant", "content": response}]
    return {"messages": messages, "tools": [TOOLS[name]]}


def make_examples(out: Path, sft: list[dict], pairs: list[dict], texts: list[dict], n: int = 64) -> None:
    """One small file per layout a user brings (docs/data.md trains on each), from the rows above."""
    def user(text):
        return {"role": "user", "content": text}

    def assistant(text):
        return {"role": "assistant", "content": text}

    hedged = [r for r in pairs if not r["rejected"].startswith(r["chosen"])][:n]
    sft, pairs, texts = sft[:n], pairs[:n], texts[:n]
    files = {
        "text.jsonl": texts,
        "prompt_response.jsonl": sft,
        "alpaca.jsonl": [{"instruction": "Answer the question.", "input": r["prompt"], "output": r["response"]}
                         if i % 2 else {"instruction": r["prompt"], "input": "", "output": r["response"]}
                         for i, r in enumerate(sft)],
        "chat.jsonl": [{"messages": [user(r["prompt"]), assistant(r["response"])]} for r in sft],
        "sharegpt.jsonl": [{"conversations": [{"from": "human", "value": r["prompt"]},
                                              {"from": "gpt", "value": r["response"]}]} for r in sft],
        # learning from rewards (data.format prompt): the question, and the fact its answer states for exact_answer
        "prompt.jsonl": [{"prompt": r["prompt"], "answer": _stated_answer(r["response"])} for r in sft],
        "preference.jsonl": pairs,
        # implicit: the prompt is where the two texts part, so no pair whose rejected text starts with the chosen
        "preference_implicit.jsonl": [{"chosen": f"{r['prompt']} {r['chosen']}",
                                       "rejected": f"{r['prompt']} {r['rejected']}"} for r in hedged],
        "preference_conversational.jsonl": [{"prompt": [user(r["prompt"])], "chosen": [assistant(r["chosen"])],
                                             "rejected": [assistant(r["rejected"])]} for r in pairs],
        "preference_ultrafeedback.jsonl": [{"prompt": r["prompt"], "prompt_id": f"{i:04d}", "score_chosen": 8.0,
                                            "score_rejected": 3.0,
                                            "chosen": [user(r["prompt"]), assistant(r["chosen"])],
                                            "rejected": [user(r["prompt"]), assistant(r["rejected"])]}
                                           for i, r in enumerate(pairs)],
    }
    files |= {
        # TRL's prompt-completion layout, plain and conversational (issue 84)
        "prompt_completion.jsonl": [{"prompt": r["prompt"], "completion": r["response"]} for r in sft],
        "prompt_completion_conversational.jsonl": [{"prompt": [user(r["prompt"])],
                                                    "completion": [assistant(r["response"])]} for r in sft],
        # OpenAI messages with tool calls: the words of a number and a sum come from a tool, its schemas per row
        "chat_tools.jsonl": [_tool_conversation(r["prompt"], r["response"]) for r in sft],
        # reasoning before the reply (reasoning_content, the field transformers' templates read)
        "chat_reasoning.jsonl": [{"messages": [user(r["prompt"]), dict(assistant(r["response"]), reasoning_content=(
            f"The answer is {_stated_answer(r['response'])}."))]} for r in sft],
    }
    for name, rows in files.items():
        _write_jsonl(out / "examples" / name, rows)
    (out / "examples" / "text.txt").write_text("".join(r["text"] + "\n" for r in texts), encoding="utf-8")


def make_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_config(vocab_size: int, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def make_moe_config(vocab_size: int, tokenizer):
    """Mixtral's architecture in the tiny Llama's width: 8 routed experts per layer, 2 per token, a load-balancing
    weight of 0.02 (Mixtral's 0.001 would hardly move the loss of a model this small)."""
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


# the tiny vision-language model's template: CHAT_TEMPLATE with an image part rendered as LLaVA's <image>
VLM_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
VLM_COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}


def make_vlm(tokenizer_dir: Path, out: Path, data_dir: Path, n: int, seed: int) -> None:
    """recipes/tiny/vlm_model/: a tiny LLaVA's config (a CLIP vision tower of 28-pixel images in 7-pixel patches:
    16 image tokens, a projector, the tiny Llama's shape in 2 layers) and its processor (the tiny tokenizer with
    <image> added, CLIP's image processing, VLM_TEMPLATE); no weights (the recipe starts from random ones).
    data/tiny_vlm/: `n` rows in TRL's vision layout, a square of one of four colours on a white or black
    background, asked for the square's colour: the answer is in the image alone (the text is the same for every row)."""
    from PIL import Image, ImageDraw
    from transformers import AutoTokenizer, CLIPVisionConfig, LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok, chat_template=VLM_TEMPLATE, patch_size=7, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    text = make_model_config(len(tok), tok)
    text.num_hidden_layers = 2
    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, image_size=28, patch_size=7,
                                                        projection_dim=64),
                         text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    processor.save_pretrained(out)
    rng = random.Random(seed)
    (data_dir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        square, background = rng.choice(list(VLM_COLOURS)), rng.choice(("white", "black"))
        image = Image.new("RGB", (28, 28), {"white": (255, 255, 255), "black": (0, 0, 0)}[background])
        x, y = rng.randint(0, 8), rng.randint(0, 8)
        ImageDraw.Draw(image).rectangle([x, y, x + 19, y + 19], fill=VLM_COLOURS[square])
        image.save(data_dir / "images" / f"{i:04d}.png", optimize=False)
        rows.append({"images": [f"images/{i:04d}.png"], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"{square}."}]}]})
    _write_jsonl(data_dir / "train.jsonl", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", type=Path, default=ROOT / "data")
    parser.add_argument("--model_dir", type=Path, default=ROOT / "recipes" / "tiny" / "model")
    parser.add_argument("--moe_dir", type=Path, default=ROOT / "recipes" / "tiny" / "moe_model")
    parser.add_argument("--vlm_dir", type=Path, default=ROOT / "recipes" / "tiny" / "vlm_model")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab_size", type=int, default=1024)
    args = parser.parse_args()

    files = make_data(args.data_dir, n_train=6000, n_val=300, n_sft=3000, seed=args.seed)
    pairs = make_preference(args.data_dir, n=800, seed=args.seed + 1)
    make_prompts(args.data_dir, n=600, seed=args.seed + 2)
    make_examples(args.data_dir, files["tiny_sft/train.jsonl"], pairs, files["tiny/train.jsonl"])
    texts = [r["text"] for r in files["tiny/train.jsonl"]]
    texts += [r["prompt"] + " " + r["response"] for r in files["tiny_sft/train.jsonl"]]
    tokenizer = make_tokenizer(texts, args.vocab_size)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.model_dir)
    make_model_config(len(tokenizer), tokenizer).save_pretrained(args.model_dir)
    make_moe_config(len(tokenizer), tokenizer).save_pretrained(args.moe_dir)
    make_vlm(args.model_dir, args.vlm_dir, args.data_dir / "tiny_vlm", n=800, seed=args.seed + 3)
    print(f"wrote {args.data_dir}, {args.model_dir}, {args.moe_dir} and {args.vlm_dir} (vocab {len(tokenizer)})")


if __name__ == "__main__":
    main()
