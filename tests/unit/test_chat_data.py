"""Chat data as people bring it (issue 84): tool calls, tool replies, reasoning and content parts kept; masks found in
the conversation rendered once by the template, for templates of four shapes written here (none copied from a model):
prefix-consistent ChatML with tools (dstrain's chatml), reasoning rendered for the last turn only, tools in the system
turn with calls in tags, and a `{% generation %}`-tagged one. The trained spans are checked against spans written out
by hand, and for the tagged template against TRL's SFTTrainer tokenizing the same rows (assistant_only_loss), token for
token. A field the template never renders is one line before anything is tokenized."""
from __future__ import annotations

import copy
import json

import pytest

from dstrain import chat_templates, data
from dstrain.chat_templates import normalize
from dstrain.config import DataConfig, ModelConfig
from dstrain.data.formats import chat, sft
from dstrain.errors import UserError
from dstrain.model import load_tokenizer

IGNORE = data.IGNORE_INDEX

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
    {"role": "assistant", "content": "", "reasoning_content": "need the weather",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "5C"},
    {"role": "assistant", "content": "It is 5C."},
]
REASONING_CONVERSATION = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
]

# reasoning rendered for the assistant turns after the last user turn only, as Qwen3's and DeepSeek-R1's templates do:
# a conversation rendered prefix by prefix shows the first turn's reasoning, rendered whole it does not
LAST_TURN_REASONING = (
    "{% set last = namespace(user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set last.user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% if loop.index0 > last.user and m.get('reasoning_content') %}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}{{ m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the function schemas inside the system turn, calls as a JSON list after a [TOOL_CALLS] tag, results in
# [TOOL_RESULTS] tags, every assistant turn closed by the EOS; no generation prompt (the model writes after [/INST])
SYSTEM_TOOLS_TAGGED_CALLS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ '[SYSTEM]' + m['content'] }}"
    "{% if tools %}{{ ' Tools: ' + (tools | tojson) }}{% endif %}{{ '[/SYSTEM]' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'tool' %}{{ '[TOOL_RESULTS]' + m['content'] + '[/TOOL_RESULTS]' }}"
    "{% elif m.get('tool_calls') %}{{ '[TOOL_CALLS][' }}{% for c in m['tool_calls'] %}"
    "{{ '{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' + (c['function']['arguments'] | tojson) + '}' }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ']' + eos_token }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
# turns not closed mid-conversation, the EOS after the conversation's last reply only: the next turn's opening tag is
# not the assistant's to learn
NO_CLOSING_MID_CONVERSATION = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% if loop.last and m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
# ChatML with the assistant's text marked for transformers' assistant mask (what TRL's assistant_only_loss reads)
GENERATION_TAGGED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + c['function']['name'] + ' ' + c['function']['arguments'] + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tokenizer(template: str | None):
    tok = load_tokenizer(ModelConfig(name_or_path="recipes/tiny/model"))
    if template is not None:
        tok.chat_template = chat_templates.TEMPLATES.get(template, template)
    return tok


def _runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """Each run of trained tokens."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _trained(ids: list[int], labels: list[int], tok) -> list[str]:
    """Each run of trained tokens, decoded."""
    return [tok.decode(run) for run in _runs(ids, labels)]


def test_normalize_keeps_what_a_template_renders():
    got = normalize(TOOL_CONVERSATION, {})
    assert got[1] == {"role": "user", "content": "Weather in Oslo?"}  # text parts joined, not the list's repr
    assert got[2]["tool_calls"] == TOOL_CONVERSATION[2]["tool_calls"] and got[2]["content"] == ""
    assert got[2]["reasoning_content"] == "need the weather"
    assert got[3] == {"role": "tool", "content": "5C", "name": "get_weather", "tool_call_id": "call_1"}
    calls_only = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": TOOL_CONVERSATION[2]["tool_calls"]}]
    assert normalize(calls_only, {})[1]["content"] == ""  # a call without content is a whole turn
    with pytest.raises(UserError, match=r"content parts of type image; only text parts are trained"):
        normalize([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}], {})
    with pytest.raises(UserError, match=r"a chat message has 'weight' \(a per-turn training switch\)"):
        normalize([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}], {})
    with pytest.raises(UserError, match=r"'tools' is text that is not JSON"):
        chat_templates.tools_of({"tools": "[{"}, "tools")
    assert chat_templates.tools_of({"tools": json.dumps([WEATHER_TOOL])}, "tools") == [WEATHER_TOOL]


@pytest.mark.parametrize("template,conversation,tools,want", [
    ("chatml", TOOL_CONVERSATION, [WEATHER_TOOL],
     ['<think>\nneed the weather\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
      '</tool_call><|im_end|>\n', "It is 5C.<|im_end|>\n"]),
    (LAST_TURN_REASONING, REASONING_CONVERSATION, None, ["4<|im_end|>\n", "<think>\nadd again\n</think>\n\n6<|im_end|>\n"]),
    (SYSTEM_TOOLS_TAGGED_CALLS, TOOL_CONVERSATION, [WEATHER_TOOL],
     ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]</s>', "It is 5C.</s>"]),
    (NO_CLOSING_MID_CONVERSATION, REASONING_CONVERSATION[:1] + [{"role": "assistant", "content": "4"}] +
     REASONING_CONVERSATION[2:3] + [{"role": "assistant", "content": "6"}], None, ["4", "6</s>"]),
], ids=["chatml-tools", "reasoning-last-turn", "system-tools-tagged-calls", "no-closing-mid-conversation"])
def test_trained_spans_are_what_the_assistant_writes(template, conversation, tools, want):
    """Hand-written spans: each assistant turn's reasoning (where the template renders it), content, tool calls and
    end of turn, and nothing of the system turn, the schemas, the user or the tool's reply."""
    tok = _tokenizer(template)
    if template == SYSTEM_TOOLS_TAGGED_CALLS:  # it renders no reasoning (which the run would refuse)
        conversation = copy.deepcopy(conversation)
        del conversation[2]["reasoning_content"]
    messages = normalize(conversation, {})
    ids, labels = sft._sft_tokens(messages, tok, tools)
    assert _trained(ids, labels, tok) == want
    # the sequence is the conversation as the template renders it whole
    assert tok.decode(ids) == tok.apply_chat_template(messages, tools=tools, tokenize=False)


def _trl_labels(rows: list[dict], tok, tmp_path) -> list[tuple[list[int], list[int]]]:
    """TRL's SFTTrainer tokenizing the rows (assistant_only_loss: transformers' assistant mask): (input_ids, labels)."""
    import datasets
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("recipes/tiny/model"))
    args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], max_length=None,
                     use_cpu=True)
    # datasets' Json feature keeps each message's own keys (a struct column would give every message every key)
    features = datasets.Features({"messages": datasets.List(datasets.Json())})
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=datasets.Dataset.from_list(rows, features=features))
    out = trainer.train_dataset
    labels = out["labels"] if "labels" in out.column_names else [
        [i if m else IGNORE for i, m in zip(ids, mask)] for ids, mask in zip(out["input_ids"], out["assistant_masks"])]
    return list(zip(out["input_ids"], labels))


def test_a_generation_tagged_template_trains_what_trl_trains(tmp_path):
    tok = _tokenizer(GENERATION_TAGGED)
    calls = [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                          {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]},
            {"messages": [{"role": "system", "content": "Count."}, {"role": "user", "content": "go"},
                          {"role": "assistant", "content": "one two"}]}]
    want = _trl_labels(copy.deepcopy(rows), tok, tmp_path)
    for row, (want_ids, want_labels) in zip(rows, want):
        ids, labels = sft._sft_tokens(normalize(row["messages"], {}), tok)
        assert (ids, labels) == (list(want_ids), list(want_labels))
    ids, labels = sft._sft_tokens(normalize(rows[0]["messages"], {}), tok)
    assert _trained(ids, labels, tok) == ["Hello<|im_end|>\n", '<tool_call>add {"a": 1, "b": 2}</tool_call><|im_end|>\n',
                                          "3<|im_end|>\n"]


@pytest.mark.parametrize("field,row", [
    ("reasoning .reasoning_content. and assistant tool calls", {"messages": TOOL_CONVERSATION[1:3]}),
    ("function schemas (tools)", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                  "tools": [WEATHER_TOOL]}),
    ("reasoning (reasoning_content)", {"messages": REASONING_CONVERSATION[:2]}),
])
def test_a_field_the_template_never_renders_is_one_line_before_tokenizing(field, row, tmp_path):
    """The tiny model's own template renders role and content only: tool calls, schemas or reasoning under it would
    train the model without them (tool calls: to answer nothing)."""
    import datasets
    tok = _tokenizer(None)
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, row]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = datasets.load_dataset("json", data_files=str(tmp_path / "rows.jsonl"))["train"]  # as a run loads it
    cfg = DataConfig(format="chat")
    with pytest.raises(UserError, match=rf"the rows hold {field.replace('(', '.').replace(')', '.')}, which the chat "
                                        rf"template \(the tokenizer's own\) never renders"):
        chat.tokenize(dataset, cfg, tok, 128, None)
    out, stats = chat.tokenize(dataset.select([0]), cfg, tok, 128, None)  # without the field: trains
    assert stats["sequences"] == 1


def test_trls_conversational_prompt_completion_trains_the_completion_only(tmp_path):
    """TRL's prompt-completion layout with message lists (refused before): the prompt's own assistant turn (a
    few-shot example) does not train, the completion's reply and end of turn do; found from its columns."""
    import datasets

    from dstrain.data.formats import looks_like, prompt_response
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                        {"role": "user", "content": "3+3?"}],
             "completion": [{"role": "assistant", "content": "6"}]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = datasets.load_dataset("json", data_files=str(tmp_path / "rows.jsonl"))["train"]
    assert looks_like(dataset) == ("prompt_response", " --data.response_field=completion")
    cfg = DataConfig(format="prompt_response", response_field="completion")
    assert prompt_response.row_problem(dataset[0], cfg) is None
    for template in ("chatml", GENERATION_TAGGED):
        tok = _tokenizer(template)
        out, stats = prompt_response.tokenize(dataset, cfg, tok, 128, None)
        ids, labels = out[0]["input_ids"], out[0]["labels"]
        assert _trained(ids, labels, tok) == ["6<|im_end|>\n"], template
    assert "or both as lists of messages" in prompt_response.row_problem({"prompt": rows[0]["prompt"], "completion": "6"},
                                                                   cfg)


def test_preference_and_rl_prompts_carry_their_tools_through_the_same_rendering(tmp_path):
    """DPO pairs and GRPO prompts with function schemas, tool calls and tool replies render as SFT renders them (the
    template given `tools`, as TRL's maybe_apply_chat_template passes them); under a template without tool support
    each is one line before tokenizing."""
    import datasets

    from dstrain.data.formats import preference, prompt
    calls = TOOL_CONVERSATION[2]["tool_calls"]
    pairs = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}],
              "chosen": [{"role": "assistant", "content": "", "tool_calls": calls}],
              "rejected": [{"role": "assistant", "content": "I cannot know."}], "tools": [WEATHER_TOOL]}]
    prompts = [{"prompt": [{"role": "user", "content": "Weather in Oslo?"},
                           {"role": "assistant", "content": "", "tool_calls": calls},
                           {"role": "tool", "name": "get_weather", "content": "5C"}], "tools": [WEATHER_TOOL]}]
    for name, rows in (("pairs", pairs), ("prompts", prompts)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs_ds = datasets.load_dataset("json", data_files=str(tmp_path / "pairs.jsonl"))["train"]
    prompts_ds = datasets.load_dataset("json", data_files=str(tmp_path / "prompts.jsonl"))["train"]
    tok = _tokenizer("chatml")
    want_prompt = tok.apply_chat_template(pairs[0]["prompt"], tools=[WEATHER_TOOL], tokenize=False,
                                          add_generation_prompt=True)
    assert "<tools>" in want_prompt and "get_weather" in want_prompt
    prompt_ids, chosen, rejected = preference.pair_tokens(pairs_ds[0], DataConfig(format="preference"), tok)
    assert tok.decode(prompt_ids) == want_prompt
    assert tok.decode(chosen) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                                  '<|im_end|>\n')
    out, _ = prompt.tokenize(prompts_ds, DataConfig(format="prompt"), tok, 256, None)
    assert tok.decode(out[0]["prompt_ids"]) == tok.apply_chat_template(
        prompts[0]["prompt"], tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    plain = _tokenizer(None)
    with pytest.raises(UserError, match=r"assistant tool calls and function schemas \(tools\), which the chat "):
        preference.tokenize(pairs_ds, DataConfig(format="preference"), plain, 256, None)
    with pytest.raises(UserError, match=r"assistant tool calls and function schemas \(tools\), which the chat "):
        prompt.tokenize(prompts_ds, DataConfig(format="prompt"), plain, 256, None)


def test_a_model_folder_without_tokenizer_files_is_one_line_naming_model_tokenizer(tmp_path):
    """transformers makes a Qwen2 (or GPT-2) tokenizer with one token of a folder that has a config and no tokenizer
    files, and every text encodes to nothing: a run trained on almost nothing. Now one line; model.tokenizer fixes it."""
    from transformers import AutoConfig
    AutoConfig.for_model("qwen2", vocab_size=576, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(UserError, match=r"has no tokenizer files .*encodes a \d+-character sentence to 0 tokens; set "
                                        r"model.tokenizer to the tokenizer the model was trained with"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "qwen2")))
    tok = load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "qwen2"), tokenizer="recipes/tiny/model"))
    assert len(tok("Hello there")["input_ids"]) > 2


def _docs_inspect_commands() -> list[list[str]]:
    import shlex

    from tests.helpers import ROOT, doc_commands
    found = [shlex.split(c) for _, c in doc_commands([ROOT / "docs/data.md"]) if "dstrain.data.inspect" in c]
    assert len(found) == 2, found
    return [words[words.index("dstrain.data.inspect") + 1:] for words in found]


def test_inspect_shows_the_trained_tokens_of_the_docs_commands(capsys):
    """docs/data.md's two `python -m dstrain.data.inspect` commands as written (in-process): brackets around what is
    trained off a terminal, and --json's documented shape, checked against the rows themselves: the text is the row
    rendered by the template, the trained runs its assistant replies with their end of turn."""
    from dstrain.data import inspect
    tools_args, json_args = _docs_inspect_commands()
    assert inspect.main(tools_args) == 0
    shown = capsys.readouterr().out
    sequences = [block.split("\n", 1)[1].rstrip("\n") for block in shown.split("--- ")[1:]]
    assert len(sequences) == 2
    tok = _tokenizer("chatml")
    rows = [json.loads(line) for line in open("data/examples/chat_tools.jsonl")]
    rendered = {tok.apply_chat_template(normalize(r["messages"], {}), tools=r["tools"], tokenize=False): r
                for r in rows}
    for sequence in sequences:
        import re
        row = rendered[sequence.replace("[[", "").replace("]]", "")]  # the sequence is a row, rendered whole
        calls = [m["tool_calls"][0]["function"] if m.get("tool_calls") else None for m in row["messages"]
                 if m["role"] == "assistant"]
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        want = [(f'<tool_call>\n{{"name": "{c["name"]}", "arguments": {json.dumps(c["arguments"])}}}\n</tool_call>'
                 if c else reply) + "<|im_end|>\n" for c, reply in zip(calls, replies)]
        assert re.findall(r"\[\[(.*?)\]\]", sequence, flags=re.S) == want
    assert inspect.main(json_args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    record = json.loads(printed[0])
    assert set(record) == {"text", "trained"}
    tok = _tokenizer(None)
    chats = [json.loads(line)["messages"] for line in open("data/tiny_chat/train.jsonl")]  # tiny/chat_sft's data
    row = next(m for m in chats if tok.apply_chat_template(m, tokenize=False) == record["text"])
    assert record["trained"] == [m["content"] + "</s>" for m in row if m["role"] == "assistant"]


# Where TRL's tags and ours differ, on purpose: DeepSeek-R1's template closes the tool outputs at the start of the
# next assistant turn (`<｜tool▁outputs▁end｜>`), which the prompt already holds at inference (its generation prompt
# after a tool reply): TRL trains that tag, we leave it to the reply. Gemma 4's diffusion template writes
# `<|tool_response>` after a call that has no reply yet, the model's stop for a call: we train it with the call, TRL
# leaves it to the reply, also when the conversation ends with the call (the reply itself, rendered inside the model's
# turn, trains in neither: test_tool_replies_inside_the_turn_never_train)
KNOWN_GAPS = {("diffusion_gemma", "tools"), ("diffusion_gemma", "ends-with-a-call"), ("deepseek_r1_distill", "tools")}
VISION = ("smolvlm", "idefics3", "llava_next", "qwen2_5_vl", "qwen3_vl", "lfm2_2_5_vl")


def test_real_model_templates_train_what_trls_training_templates_mark():
    """The real chat templates TRL ships (Qwen2.5/3.x, Llama 3, Gemma, gpt-oss, DeepSeek, Phi-3, Cohere, LFM2,
    Nemotron, ...), each beside TRL's rewrite of it with `{% generation %}` tags: where the two render a
    conversation to the same text, our spans on the untagged original are the tagged spans transformers finds, up to
    characters the generation prompt already gives the model (TRL's tags also cover `<|im_start|>assistant`-style
    headers on some models: the model never writes them). Single and multi-turn, tool calls, a conversation ending
    with a call (an agent's step: gpt-oss's last `<|call|>` trained as `<|call` before), reasoning."""
    from pathlib import Path

    import trl
    from transformers.utils.chat_template_utils import render_jinja_template
    folder = Path(trl.__file__).parent / "chat_templates"
    conversations = {"single": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}],
                                None),
                     "multi": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"}], None),
                     "tools": (TOOL_CONVERSATION[1:], [WEATHER_TOOL]),
                     "ends-with-a-call": (TOOL_CONVERSATION[1:3], [WEATHER_TOOL]),
                     "reasoning": (REASONING_CONVERSATION, None)}
    tok = _tokenizer(None)
    compared, gaps = 0, set()
    for tagged in sorted(folder.glob("*_training.jinja")):
        original = folder / tagged.name.replace("_training", "")
        if not original.exists() or original.stem in VISION:
            continue
        for name, (conversation, tools) in conversations.items():
            messages = normalize(conversation, {})
            try:
                plain = render_jinja_template([messages], tools=tools, chat_template=original.read_text(),
                                              bos_token=tok.bos_token, eos_token=tok.eos_token)[0][0]
                marked, generation = render_jinja_template([messages], tools=tools, chat_template=tagged.read_text(),
                                                           return_assistant_tokens_mask=True, bos_token=tok.bos_token,
                                                           eos_token=tok.eos_token)
            except Exception:  # noqa: BLE001 - the template refuses this conversation (no tools, no system turn)
                continue
            if marked[0] != plain:  # TRL's rewrite renders another text (e.g. every turn's <think> block)
                continue
            tok.chat_template = original.read_text()
            text, pieces = sft.assistant_spans(messages, tok, tools)
            ours = [(turn[0][0], turn[-1][1]) for turn in pieces]  # a reply inside the turn: checked below
            theirs = []
            for a, b in generation[0]:  # adjacent tagged blocks are one span
                theirs = theirs[:-1] + [(theirs[-1][0], b)] if theirs and theirs[-1][1] == a else theirs + [(a, b)]
            turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            agree = len(ours) == len(theirs)
            for (start, end), (their_start, their_end), turn in zip(ours, theirs, turns):
                prompt = sft._render(tok, messages[:turn], tools, generation_prompt=True)
                before = sft._render(tok, messages[:turn], tools)
                header = prompt[len(before):] if prompt.startswith(before) else ""
                agree &= end == their_end and their_start <= start and text[their_start:start] in header
            compared += 1
            if not agree:
                gaps.add((original.stem, name))
    assert gaps == KNOWN_GAPS and compared >= 80, (sorted(gaps), compared)


def test_tool_calls_train_where_the_template_writes_only_the_call_and_tool_replies_never_train():
    """gpt-oss renders a calling turn as its call alone (`<|start|>assistant to=functions.get_weather<|channel|>
    commentary json<|message|>{...}<|call|>`, the turn's content dropped): its calls trained nothing before (the span
    was empty). Gemma 4's diffusion template renders the tool's reply inside the model's turn
    (`<tool_call|><|tool_response>response:...<tool_response|>`): the reply trained as the model's text before, teaching
    it to write tool results itself. Both real templates as TRL ships them, through the run's tokenization."""
    from pathlib import Path

    import trl
    folder = Path(trl.__file__).parent / "chat_templates"
    messages = normalize(TOOL_CONVERSATION[1:], {})
    tok = _tokenizer((folder / "gptoss.jinja").read_text())
    assert _trained(*sft._sft_tokens(messages, tok, [WEATHER_TOOL]), tok) == [
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
        "<|channel|>final<|message|>It is 5C.<|return|>"]
    tok = _tokenizer((folder / "diffusion_gemma.jinja").read_text())
    trained = _trained(*sft._sft_tokens(messages, tok, [WEATHER_TOOL]), tok)
    assert trained == ['<|channel>thought\nneed the weather\n<channel|><|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}'
                       '<tool_call|><|tool_response>', "It is 5C.<turn|>\n"]
    assert not any("5C<" in piece for piece in trained)  # the reply's text, the caller's to give


# openai-harmony's own renderer (gpt-oss's format) and gpt-oss's Jinja template (as TRL ships it) disagree in two
# places, both in text the model is given, never in what it writes: the template ends the developer instructions with
# a blank line when no tools follow, and writes a tool's reply as a JSON string ("5C" for 5C)
GPT_OSS_TEMPLATE_NOT_HARMONY = (("Be brief.\n\n<|end|>", "Be brief.<|end|>"), ('<|message|>"5C"<|end|>', "<|message|>5C<|end|>"))
O200K_PATTERN = "|".join([  # o200k's pre-tokenizer, as tiktoken and openai-harmony split text
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


@pytest.fixture(scope="module")
def gpt_oss():
    """openai-harmony's encoding and gpt-oss's tokenizer (its o200k vocabulary and special tokens, TRL's copy of its
    template). The vocabulary is fetched by `make test`/`make test-fast` (scripts/harmony_vocab.py): harmony's own
    download needs OpenAI's blob store."""
    import os
    import sys
    from pathlib import Path

    import trl
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    folder = os.environ.get("TIKTOKEN_ENCODINGS_BASE") or str(Path(sys.prefix) / "share" / "tiktoken")
    vocab = Path(folder) / "o200k_base.tiktoken"
    if not vocab.exists():
        message = f"{vocab} missing: `make test-fast` fetches it (scripts/harmony_vocab.py)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    with pytest.MonkeyPatch.context() as patch:  # read by harmony's loader at the call
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", folder)
        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    specials = sorted(encoding.special_tokens_set, key=lambda name: encoding.encode(name, allowed_special="all"))
    converted = TikTokenConverter(vocab_file=str(vocab), pattern=O200K_PATTERN, extra_special_tokens=specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=converted.converted(), eos_token="<|return|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja").read_text()
    return encoding, tok


def _harmony_messages(messages: list[dict], tools) -> list:
    """The conversation as openai-harmony's own objects, written from its documentation: a system message (today's
    date, as the template writes it), the system prompt and function schemas as the developer message, reasoning on
    the analysis channel, each call on the commentary channel to functions.NAME, the reply on the final channel."""
    import datetime

    from openai_harmony import Author, DeveloperContent, Message, Role, SystemContent, ToolDescription
    out = [Message.from_role_and_content(
        Role.SYSTEM, SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat()))]
    developer = None
    if messages[0]["role"] == "system":
        developer, messages = DeveloperContent.new().with_instructions(messages[0]["content"]), messages[1:]
    if tools:
        developer = (developer or DeveloperContent.new()).with_function_tools([
            ToolDescription.new(t["function"]["name"], t["function"]["description"], parameters=t["function"]["parameters"])
            for t in tools])
    if developer is not None:
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    for m in messages:
        if m["role"] == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif m["role"] == "tool":
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, "functions." + m["name"]), m["content"])
                       .with_recipient("assistant").with_channel("commentary"))
        else:
            if m.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis"))
            for call in m.get("tool_calls") or []:
                out.append(Message.from_role_and_content(Role.ASSISTANT, json.dumps(call["function"]["arguments"]))
                           .with_channel("commentary").with_recipient("functions." + call["function"]["name"])
                           .with_content_type("json"))
            if m["content"]:
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
    return out


def _harmony_trained(encoding, messages: list) -> tuple[list[int], list[list[int]]]:
    """harmony's training rendering and what the model writes in it: each run of assistant messages located in the
    rendering (harmony drops earlier reasoning, and ends the last message with <|return|>), less the `<|start|>
    assistant` a generation prompt gives. The located messages must tile the rendering: nothing else is in it."""
    from openai_harmony import Conversation, Role
    ids = encoding.render_conversation_for_training(Conversation.from_messages(messages))
    ends = [encoding.encode(t, allowed_special="all")[0] for t in ("<|end|>", "<|return|>")]
    header = encoding.encode("<|start|>assistant", allowed_special="all")
    # the system and developer messages as one block (the system message names the tools' channel when the
    # developer message holds functions), then message by message
    lead = next(i for i, m in enumerate(messages) if m.author.role not in (Role.SYSTEM, Role.DEVELOPER))
    at, runs = len(encoding.render_conversation(Conversation.from_messages(messages[:lead]))), []
    for message in messages[lead:]:
        own = encoding.render(message)
        if ids[at:at + len(own)] != own and own[-1] == ends[0]:
            own = own[:-1] + [ends[1]]
        if ids[at:at + len(own)] != own:
            assert message.author.role == Role.ASSISTANT and message.channel == "analysis", message  # dropped
            continue
        if message.author.role == Role.ASSISTANT:
            if runs and runs[-1][1] == at:
                runs[-1][1] = at + len(own)
            else:
                assert own[:len(header)] == header
                runs.append([at + len(header), at + len(own)])
        at += len(own)
    assert at == len(ids)
    return ids, [ids[a:b] for a, b in runs]


@pytest.mark.parametrize("conversation,tools", [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}], None),
    (REASONING_CONVERSATION, None),
    (TOOL_CONVERSATION, [WEATHER_TOOL]),
    (TOOL_CONVERSATION[:3], [WEATHER_TOOL]),
], ids=["single", "multi-turn", "reasoning", "tools", "ends-with-a-call"])
def test_gpt_oss_trains_what_openai_harmony_writes_for_the_assistant(gpt_oss, conversation, tools):
    """gpt-oss's real format, rendered by OpenAI's openai-harmony on the real o200k vocabulary: the run's ids are
    harmony's training rendering token for token (but for the template's two known departures above, in the given
    text), and the trained tokens are exactly harmony's assistant messages (reasoning on the last turn only, calls
    with their recipient, <|end|>, <|call|> and <|return|>), less the header the generation prompt gives."""
    encoding, tok = gpt_oss
    messages = normalize(conversation, {})
    ids, labels = sft._sft_tokens(messages, tok, tools)
    want_ids, want_runs = _harmony_trained(encoding, _harmony_messages(messages, tools))
    assert _runs(ids, labels) == want_runs
    text = tok.decode(ids)
    for template, harmony in GPT_OSS_TEMPLATE_NOT_HARMONY:
        text = text.replace(template, harmony)
    assert text == encoding.decode_utf8(want_ids)
    if text == tok.decode(ids):  # where the template renders as harmony does: the same tokens
        assert ids == want_ids


def test_trls_loss_switches(tmp_path):
    """data.assistant_only_loss and data.completion_only_loss as TRL combines its masks: on a conversational
    prompt-completion row whose prompt holds an assistant turn, the completion (default), every assistant turn
    (completion_only_loss false), the completion's every token (assistant_only_loss false), or everything."""
    from dstrain.data.formats import prompt_response
    row = {"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "3+3?"}], "completion": [{"role": "assistant", "content": "6"}]}
    tok = _tokenizer("chatml")
    text = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    for switches, want in (({}, ["6<|im_end|>\n"]),
                           ({"completion_only_loss": False}, ["4<|im_end|>\n", "6<|im_end|>\n"]),
                           ({"assistant_only_loss": False}, [text[len(prompt):]]),
                           ({"assistant_only_loss": False, "completion_only_loss": False}, [text])):
        cfg = DataConfig(format="prompt_response", response_field="completion", **switches)
        messages = prompt_response.to_messages(row, cfg)
        ids, labels = sft._with_options(messages, tok, None, cfg)
        assert _trained(ids, labels, tok) == want, switches


@pytest.mark.parametrize("template", ["chatml", "tagged"])
def test_last_turn_only_trains_the_last_assistant_turn(template):
    """data.last_turn_only (LLaMA-Factory's mask_history): a conversation's last assistant turn trains, the turns
    before it are its prompt; under a `{% generation %}` template through transformers' mask, under ChatML through the
    spans; with assistant_only_loss false, all that follows the prompt. Refused beside completion_only_loss false."""
    tok = _tokenizer(GENERATION_TAGGED if template == "tagged" else "chatml")
    messages = normalize(REASONING_CONVERSATION, {})
    text = tok.apply_chat_template(messages, tokenize=False)
    prompt = tok.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
    every = _trained(*sft._with_options(messages, tok, None, DataConfig(format="chat")), tok)
    assert len(every) == 2 and "4<|im_end|>" in every[0] and "6<|im_end|>" in every[1]
    last = _trained(*sft._with_options(messages, tok, None, DataConfig(format="chat", last_turn_only=True)), tok)
    assert last == [every[1]]
    rest = _trained(*sft._with_options(messages, tok, None, DataConfig(format="chat", last_turn_only=True,
                                                                          assistant_only_loss=False)), tok)
    assert rest == [text[len(prompt):]]
    with pytest.raises(UserError, match="data.last_turn_only=true trains the last assistant turn only"):
        DataConfig(format="chat", last_turn_only=True, completion_only_loss=False)


def test_message_keys_no_template_gets_are_said_in_the_data_line(tmp_path):
    """A message key outside what a template is given (an `id`, a `timestamp`) was dropped without a word; the data
    line now names it, as it names unread columns. Keys with no value anywhere (a JSON schema's filler) are not."""
    import datasets

    from dstrain.data.formats import report, tokenize
    rows = [{"messages": [{"role": "user", "content": "a", "id": "m1"},
                          {"role": "assistant", "content": "b", "id": "m2", "timestamp": "12:00"}]},
            {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = datasets.load_dataset("json", data_files=str(tmp_path / "rows.jsonl"))["train"]  # as a run loads it
    _, stats = tokenize(dataset, DataConfig(format="chat", chat_template="chatml"), _tokenizer("chatml"), 128)
    assert stats["unread_keys"] == ["id", "timestamp"]
    assert report(stats, 128).endswith("; message keys id, timestamp not given to the chat template (it gets role, "
                                       "content, tool calls, names and reasoning: docs/data.md)")
    _, stats = tokenize(dataset.map(lambda r: {"messages": [{"role": m["role"], "content": m["content"]}
                                                            for m in r["messages"]]}),
                        DataConfig(format="chat", chat_template="chatml"), _tokenizer("chatml"), 128)
    assert stats["unread_keys"] == [] and "message key" not in report(stats, 128)


def _mistral_folder(tmp_path):
    """A model folder as Mistral ships its newer models: tekken.json (mistral-common's own v3 file), no template."""
    import shutil
    from pathlib import Path

    import mistral_common
    shutil.copy(Path(mistral_common.__file__).parent / "data" / "tekken_240911.json", tmp_path / "tekken.json")
    return tmp_path


def test_a_mistral_tokenizer_without_a_template_gives_dpo_pairs_grpo_prompts_and_completion_masks(tmp_path):
    """Issue 84: with Mistral's tekken.json and no Jinja template, preference and prompt data were refused ("not
    supported yet"), and a prompt-completion row with assistant_only_loss false raised mistral-common's
    InvalidMessageStructureException (its finetuning mode encodes only conversations ending with the assistant). The
    prompts are now mistral-common's own inference encoding of them (test mode: up to `[/INST]`, where the model
    writes), and each response what its finetuning encoding adds after that prompt, with the EOS."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from dstrain.data.formats import preference, prompt

    folder = _mistral_folder(tmp_path)
    tok = load_tokenizer(ModelConfig(name_or_path=str(folder)))
    for fmt in ("preference", "prompt"):
        assert chat_templates.apply(None, tok, print, fmt) == "mistral-common's (tekken.json)"
    inference = MistralTokenizer.from_file(str(folder / "tekken.json"), mode=ValidationMode.test)
    finetuning = MistralTokenizer.from_file(str(folder / "tekken.json"), mode=ValidationMode.finetuning)

    def theirs(tokenizer, messages):
        return tokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens

    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    want = theirs(inference, asked)
    assert tok.decode(want) == "<s>[INST]Hi[/INST]Hello.</s>[INST]Be brief.\n\n2+2?[/INST]"
    assert prompt.prompt_ids(asked, tok) == want  # GRPO
    row = {"prompt": asked, "chosen": [{"role": "assistant", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    got = preference.pair_tokens(row, DataConfig(format="preference"), tok)
    assert got[0] == want
    for side, ids in zip(("chosen", "rejected"), got[1:]):
        full = theirs(finetuning, asked + row[side])
        assert full[:len(want)] == want and ids == full[len(want):] and tok.decode(ids).endswith("</s>")
    completion = type("Rows", (list,), {})(normalize(asked + row["chosen"], {}))
    completion.prompt_turns = len(asked)
    ids, labels = sft._with_options(completion, tok, None, DataConfig(format="chat", assistant_only_loss=False))
    assert ids == theirs(finetuning, asked + row["chosen"]) and _trained(ids, labels, tok) == ["4</s>"]


def test_a_mistral_tokenizer_without_a_template_trains_on_mistral_commons_own_format(tmp_path, monkeypatch):
    """A folder with Mistral's tekken.json and no Jinja template trained on dstrain's `plain` format before (with a
    note): neither Mistral's [INST] format nor its tool calls. Now mistral-common renders it: the ids are
    mistral-common's own encoding of the conversation (the system prompt inside the last user turn, where its v3
    puts it: not prefix by prefix), the trained tokens each assistant message's reply or calls and its EOS, written out
    here; reasoning, which this format has no place for, is one line before anything is tokenized."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    folder = _mistral_folder(tmp_path)
    tok = load_tokenizer(ModelConfig(name_or_path=str(folder)))
    assert chat_templates.apply(None, tok, print, "chat") == "mistral-common's (tekken.json)"
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")  # transformers' conversion of tekken.json leaves them unset
    reference = MistralTokenizer.from_file(str(folder / "tekken.json"), mode=ValidationMode.finetuning)
    multi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}]
    tools_row = [m for m in copy.deepcopy(TOOL_CONVERSATION) if m["role"] != "system"]
    del tools_row[1]["reasoning_content"]
    openai = copy.deepcopy(tools_row)  # the same conversation as mistral-common reads it: ids of 9, JSON arguments
    openai[1]["tool_calls"][0] |= {"id": "call00000"}
    openai[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Oslo"})
    openai[2]["tool_call_id"] = "call00000"
    openai[0]["content"] = "Weather in Oslo?"
    for messages, tools, theirs, want in (
            (multi, None, multi, ["Hello there.</s>", "4</s>"]),
            (tools_row, [WEATHER_TOOL], openai,
             ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "call00000"}]</s>',
              "It is 5C.</s>"])):
        ids, labels = sft._sft_tokens(normalize(messages, {}), tok, tools)
        request = ChatCompletionRequest.from_openai(theirs, tools=tools)
        assert ids == reference.encode_chat_completion(request).tokens
        assert _trained(ids, labels, tok) == want
    assert tok.decode(sft._sft_tokens(normalize(multi, {}), tok)[0]) == \
        "<s>[INST]Hi[/INST]Hello there.</s>[INST]Be brief.\n\n2+2?[/INST]4</s>"
    with pytest.raises(UserError, match="reasoning \\(reasoning_content\\), which the chat template "
                                        "\\(mistral-common's\\) never renders"):
        chat_templates.check_rendered([(normalize(REASONING_CONVERSATION, {}), None)], tok, None)
    monkeypatch.setitem(__import__("sys").modules, "mistral_common", None)  # not installed
    with pytest.raises(UserError, match="the model's tokenizer is Mistral's \\(tekken.json\\) with no chat template: "
                                        "pip install mistral-common"):
        chat_templates.apply(None, tok, print, "chat")
