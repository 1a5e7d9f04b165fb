"""The chat template is a recipe choice, said when defaulted, and exported with the model (issue 16, defect 4):
a tokenizer without a template trained on an unnamed format and exported none, so apply_chat_template failed
on the model just trained; ShareGPT-style data gave a jinja traceback."""
import json
import shutil

from transformers import AutoTokenizer

from tests.helpers import launch

COMMON = ["--train.max_steps=1", "--train.seq_len=64", "--train.micro_batch_size=2", "--eval.every=0",
          "--log.wandb=false", "--log.progress_bar=false", "--log.plot=false", "--data.format=chat",
          "--data.val_fraction=0"]
MESSAGES = [{"role": "user", "content": "Mira had two keys?"}, {"role": "assistant", "content": "Yes, two."}]


def test_templates_are_chosen_said_and_exported(tmp_path, cache, tiny_llama):
    bare = tmp_path / "bare-model"  # the same model, its tokenizer without a chat template
    shutil.copytree(tiny_llama, bare)
    (bare / "chat_template.jinja").unlink()
    assert AutoTokenizer.from_pretrained(bare).chat_template is None
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps({"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": f"How many keys, {i}?"},
        {"from": "gpt", "value": f"{i % 3} keys."}]}) + "\n" for i in range(40)))

    defaulted = tmp_path / "defaulted"
    proc = launch(COMMON + [f"--model.name_or_path={bare}", "--data.path=data/tiny_chat", "--output_dir",
                            str(defaulted)], cache, launcher="warm-python")
    assert "the tokenizer has no chat template; training on dstrain's plain format" in proc.stderr
    exported = AutoTokenizer.from_pretrained(defaulted / "hf")
    assert exported.apply_chat_template(MESSAGES, tokenize=False) == \
        "<s>user: Mira had two keys?\nassistant: Yes, two.</s>"  # the documented plain format, spelled out

    chosen = tmp_path / "chatml"
    proc = launch(COMMON + [f"--model.name_or_path={bare}", f"--data.path={sharegpt}",
                            "--data.messages_field=conversations", "--data.chat_template=chatml",
                            "--train.seq_len=256", "--output_dir",
                            str(chosen)], cache, launcher="warm-python")
    assert "has no chat template" not in proc.stderr
    exported = AutoTokenizer.from_pretrained(chosen / "hf")
    assert exported.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False) == \
        "<|im_start|>user\nMira had two keys?<|im_end|>\n<|im_start|>assistant\nYes, two.<|im_end|>\n"
    assert json.loads((chosen / "run_info.json").read_text())["chat_template"] == "chatml"
