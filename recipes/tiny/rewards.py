"""Reward functions for recipes/tiny/grpo.yaml, in TRL's convention: the prompts, the completions, and every other
column of the data (here `answer`) as lists, one value per completion back (None where a function does not apply).
"""


def says_the_count(prompts, completions, answer, **kwargs):
    """1.0 when the completion's first word is the count the story adds up to, else 0.0 (hard for a tiny model)."""
    words = [completion.split()[:1] for completion in completions]
    return [float(bool(w) and w[0].strip(".,") == a) for w, a in zip(words, answer)]


def one_sentence(prompts, completions, **kwargs):
    """1.0 when the completion finishes its sentence and stops there (the story's end), else 0.0: the pretrained
    model goes on with another sentence about half the time, so there is something to learn within a minute."""
    return [float(c.strip().endswith(".") and c.count(".") == 1) for c in completions]
