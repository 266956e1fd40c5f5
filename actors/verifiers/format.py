"""The `format` built-in reward: 1.0 when a completion is its reasoning in think tags, then its answer in
answer tags, and nothing else; else 0.0 (DeepSeek-R1's format reward):

    <think> ... </think> <answer> ... </answer>

Whitespace may surround and separate the two blocks; each of the four tags appears exactly once (a
second `<think>` inside the reasoning fails it, so the answer cannot be smuggled in twice). What the
tags hold is not judged: pair it with `math` or another reward for that.

Options (`configure`, from `scorer.reward_fn_options`): `think_tag` and `answer_tag`, the tags' names
("think", "answer" by default). Without `configure` the defaults apply.
"""

from __future__ import annotations

import re

DEFAULTS = {"think_tag": "think", "answer_tag": "answer"}
_TAG_NAME = re.compile(r"[A-Za-z][\w.-]*")


def layout(think_tag: str, answer_tag: str) -> tuple[re.Pattern, tuple[str, ...]]:
    """The pattern a well-formatted completion matches whole, and the four tags it holds once each."""
    t, a = re.escape(think_tag), re.escape(answer_tag)
    pattern = re.compile(rf"\s*<{t}>.*</{t}>\s*<{a}>.*</{a}>\s*", re.DOTALL)
    return pattern, (f"<{think_tag}>", f"</{think_tag}>", f"<{answer_tag}>", f"</{answer_tag}>")


_layout = layout(**DEFAULTS)  # what `configure` last set


def configure(options: dict) -> None:
    """Set the tags' names (see the module docstring); a key not given takes its default."""
    global _layout
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"scorer.reward_fn_options: unknown keys {unknown} for `format` "
                         f"(allowed: {sorted(DEFAULTS)})")
    settings = {**DEFAULTS, **options}
    for key, name in settings.items():
        if not isinstance(name, str) or not _TAG_NAME.fullmatch(name):
            raise ValueError(f"scorer.reward_fn_options.{key}={name!r}: expected a tag name (a letter, "
                             "then letters, digits, '_', '-' or '.')")
    if settings["think_tag"] == settings["answer_tag"]:
        raise ValueError(f"scorer.reward_fn_options: think_tag and answer_tag are both {settings['think_tag']!r}")
    _layout = layout(settings["think_tag"], settings["answer_tag"])


def well_formatted(completion: str) -> bool:
    """Is `completion` exactly a think block then an answer block (see the module docstring)?"""
    pattern, tags = _layout
    return all(completion.count(tag) == 1 for tag in tags) and pattern.fullmatch(completion) is not None


def reward_fn(prompts, completions, labels, **columns) -> list[float]:
    """1.0 for each well-formatted completion, else 0.0; labels are not used."""
    return [1.0 if isinstance(c, str) and well_formatted(c) else 0.0 for c in completions]
