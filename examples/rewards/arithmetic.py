"""A sample reward function for the arithmetic task (demo/arithmetic.py): exact match.

Use it with `python -m launch.scorer --scorer.kinds reward_fn --scorer.reward_fn examples/rewards/arithmetic.py`.
The scorer calls `reward_fn` with whole batches; it must return one finite float per sample.
"""

EOS = "</s>"


def answer(completion: str) -> str:
    """The completion up to the first newline or eos, without surrounding spaces."""
    return completion.split("\n", 1)[0].split(EOS, 1)[0].strip()


def reward_fn(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]:
    """1.0 where the answer equals the label, else 0.0 (also when there is no label)."""
    return [1.0 if label is not None and answer(c) == label.strip() else 0.0 for c, label in zip(completions, labels)]
