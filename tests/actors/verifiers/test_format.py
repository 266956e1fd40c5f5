"""The `format` built-in reward (actors/verifiers/format.py): think then answer tags, nothing else."""

from __future__ import annotations

import pytest

from actors.verifiers.format import configure, reward_fn


@pytest.fixture(autouse=True)
def default_options():
    configure({})
    yield
    configure({})


@pytest.mark.parametrize("completion,reward", [
    ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
    ("  \n<think>\nline one\nline two\n</think>\n\n<answer> 4 </answer>\n", 1.0),  # whitespace around and between
    ("<think></think><answer></answer>", 1.0),  # what the tags hold is not judged
    ("<answer>4</answer><think>2+2</think>", 0.0),  # the wrong order
    ("<think>2+2</think>", 0.0),  # no answer
    ("<answer>4</answer>", 0.0),  # no reasoning
    ("Sure! <think>2+2</think><answer>4</answer>", 0.0),  # text before
    ("<think>2+2</think><answer>4</answer> Hope that helps.", 0.0),  # text after
    ("<think>2+2</think> so: <answer>4</answer>", 0.0),  # text between
    ("<think>a</think><think>b</think><answer>4</answer>", 0.0),  # a tag twice
    ("<think>2+2 <answer>5</answer></think><answer>4</answer>", 0.0),  # an answer inside the reasoning
    ("<think>2+2<answer>4</answer>", 0.0),  # the reasoning never closes
    ("<think>2+2</think><answer>4", 0.0),  # the answer never closes
    ("<Think>2+2</Think><answer>4</answer>", 0.0),  # tags are case-sensitive
    ("", 0.0),
])
def test_reward(completion, reward):
    assert reward_fn(["q"], [completion], [None]) == [reward]


def test_reward_fn_is_batched_and_takes_the_rows_other_columns():
    ok, bad = "<think>x</think><answer>y</answer>", "y"
    assert reward_fn(["q"] * 3, [ok, bad, ok], ["1", None, "2"], source=["a", "b", None]) == [1.0, 0.0, 1.0]


def test_configure_renames_the_tags():
    configure({"think_tag": "reasoning", "answer_tag": "final-answer"})
    assert reward_fn(["q", "q"], ["<reasoning>x</reasoning> <final-answer>y</final-answer>",
                                  "<think>x</think><answer>y</answer>"], [None, None]) == [1.0, 0.0]
    configure({"think_tag": "reasoning"})  # the answer tag back to its default
    assert reward_fn(["q"], ["<reasoning>x</reasoning><answer>y</answer>"], [None]) == [1.0]


@pytest.mark.parametrize("options,message", [
    ({"think": "t"}, "unknown keys ['think'] for `format` (allowed: ['answer_tag', 'think_tag'])"),
    ({"think_tag": "<think>"}, "think_tag='<think>': expected a tag name"),
    ({"answer_tag": ""}, "answer_tag='': expected a tag name"),
    ({"answer_tag": 3}, "answer_tag=3: expected a tag name"),
    ({"think_tag": "answer"}, "think_tag and answer_tag are both 'answer'"),
])
def test_configure_rejects_bad_options(options, message):
    with pytest.raises(ValueError) as e:
        configure(options)
    assert message in str(e.value)
    assert reward_fn(["q"], ["<think>x</think><answer>y</answer>"], [None]) == [1.0]  # the defaults still hold
