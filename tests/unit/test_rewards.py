"""dstrain/objectives/rewards.py: reward functions named as users name them, called in TRL's convention, combined
as TRL's GRPOTrainer combines them, and every way a user's function can go wrong said in one line."""
import math
import re

import pytest
import torch

from dstrain.errors import UserError
from dstrain.objectives import rewards

PROMPTS = ["2+2?", "3+4?", "capital of France?", "5*5?"]
COMPLETIONS = ["it is 4", "The answer is \\boxed{7}.", "paris", "#### 24"]
IDS = [[1, 2], [3], [4, 5, 6], [7]]
COLUMNS = {"answer": ["#### 4", "7", "Paris", "25"]}


def test_exact_answer_reads_final_answers():
    assert rewards.exact_answer(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 1.0, 1.0, 0.0]
    assert rewards.final_answer("so 1,234 apples.") == "1234"
    assert rewards.exact_answer(["q"], [[{"role": "assistant", "content": "it is 3"}]], answer=[None]) == [None]
    with pytest.raises(UserError, match="needs an `answer` column"):
        rewards.exact_answer(PROMPTS, COMPLETIONS)


def test_a_file_a_module_and_the_built_ins_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a file is found relative to the working directory, as data.path is
    (tmp_path / "my_rewards.py").write_text("def short(prompts, completions, **kw):\n"
                                            "    return [1.0 if len(c) < 8 else None for c in completions]\n")
    short = rewards.load("my_rewards.py:short")
    assert short.fn(PROMPTS, COMPLETIONS) == [1.0, None, 1.0, 1.0]
    think = rewards.load("trl.rewards:think_format_reward")  # TRL's own, as users name it
    assert think.fn(completions=[[{"content": "<think>\nhm\n</think>\n4"}]]) == [1.0]
    fmt = rewards.load("format_regex", pattern=r".*\\boxed\{.*\}.*")
    assert fmt.fn(PROMPTS, COMPLETIONS) == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("spec,message", [
    ("nothing", "name a built-in (exact_answer, format_regex, overlong_penalty) or 'path/to/file.py:name'"),
    ("missing.py:f", "no file missing.py"),
    ("json:nope", "json has no function nope"),
    ("no_such_package_x:f", "cannot import no_such_package_x"),
])
def test_a_reward_that_cannot_be_found_is_one_line(spec, message):
    with pytest.raises(UserError, match=re.escape(message)):
        rewards.load(spec)


def test_score_combines_as_trl_does():
    """Weighted nansum over the functions; a completion no function scores stays NaN (TRL's unscorable)."""
    first = rewards.Reward("first", lambda prompts, completions, **kw: [1.0, None, None, 0.5])
    second = rewards.Reward("second", lambda prompts, completions, completion_ids, **kw:
                            [float(len(i)) if i[0] != 4 else None for i in completion_ids])
    per_func, total = rewards.score([first, second], [2.0, 0.5], PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert per_func[:, 0].tolist()[0] == 1.0 and math.isnan(per_func[1, 0])
    assert total.tolist()[:2] == [2.0 + 1.0, 0.5] and math.isnan(total[2]) and total[3] == 1.0 + 0.5
    as_tensor = rewards.Reward("t", lambda prompts, completions, **kw: torch.tensor([1.0, 0.0, 0.0, 2.0]))
    assert rewards.score([as_tensor], None, PROMPTS, COMPLETIONS, IDS, COLUMNS)[1].tolist() == [1.0, 0.0, 0.0, 2.0]
    with pytest.raises(UserError, match="2 reward weights for 1 reward functions"):
        rewards.score([first], [1.0, 2.0], PROMPTS, COMPLETIONS, IDS, COLUMNS)


def _bad(values=None, raise_on=None):
    def fn(prompts, completions, **kw):
        if raise_on is not None and raise_on in prompts:
            raise KeyError("no such key")
        return values if values is not None else [0.0] * len(completions)
    return rewards.Reward("mine.py:fn", fn)


@pytest.mark.parametrize("reward,message", [
    (_bad(raise_on="capital of France?"), "reward function mine.py:fn raised KeyError: 'no such key' on completion 2"),
    (_bad(values=[1.0, 2.0]), "returned 2 values for 4 completions"),
    (_bad(values=[1.0, float("nan"), 0.0, 0.0]), "returned nan for completion 1"),
    (_bad(values=[1.0, 0.0, "1", 0.0]), "returned '1' for completion 2"),
    (_bad(values=torch.ones(3)), "returned 3 values for 4 completions"),
    (_bad(values=5.0), "returned float values for 4 completions"),
])
def test_a_reward_function_that_misbehaves_is_named_with_the_completion(reward, message):
    with pytest.raises(UserError, match=re.escape(message)) as err:
        rewards.score([reward], None, PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert "\n" not in str(err.value)


def test_overlong_penalty_is_dapos_as_trl_writes_it():
    """The built-in overlong_penalty against TRL's get_soft_overlong_punishment on every length up to past the
    maximum (TRL is the development dependency it is checked against)."""
    from trl.rewards import get_soft_overlong_punishment
    ours = rewards.load("overlong_penalty", max_completion_length=20, cache=6)
    theirs = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)
    ids = [[7] * n for n in range(0, 24)]
    assert ours.fn(completion_ids=ids) == pytest.approx(theirs(completion_ids=ids))
    assert ours.fn(completion_ids=[[1] * 17]) == [pytest.approx(-0.5)]
