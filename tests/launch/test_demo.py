"""launch.demo's own flags: the model it trains (`--demo.model`), without a run."""

from __future__ import annotations

import pytest

from launch.demo import DEMO_DEFAULTS, split_demo_args


def test_the_moe_demo_warms_longer_unless_told_and_the_llama_is_the_default():
    demo, rest = split_demo_args(["--demo.model", "qwen3_moe", "--learner.lr", "1e-4"])
    assert (demo["model"], demo["warm_steps"], rest) == ("qwen3_moe", 500, ["--learner.lr", "1e-4"])
    assert split_demo_args(["--demo.model=qwen3_moe", "--demo.warm_steps", "50"])[0]["warm_steps"] == 50
    assert split_demo_args([])[0]["model"] == "llama" and DEMO_DEFAULTS["warm_steps"] == 375


@pytest.mark.parametrize("argv", [["--demo.model", "gpt2"], ["--demo.model", "qwen3_moe", "--demo.task", "calc"]])
def test_a_model_the_demo_cannot_train_is_refused_with_the_choices(argv):
    with pytest.raises(SystemExit) as e:
        split_demo_args(argv)
    assert "qwen3_moe" in str(e.value) and "single-turn" in str(e.value)
