"""The agent demos' pieces (launch.demo --demo.task calc / guess), without a run: the warm starts'
examples and their loss masks, the held-out splits, and the run configs examples/agent.yaml (calc)
and examples/guess.yaml."""

from __future__ import annotations

import json

import pytest

from demo.arithmetic import encode_segments
from demo.guess import CORRECT, HIGHER, LOWER, MAX_TURNS, TURN_PENALTY, Game, bisection_segments, prompt_of, reachable
from demo.tiny_model import build_tokenizer
from launch.demo import AGENT_CONFIG, GUESS_CONFIG, ROOT, guess_data, split_demo_args, subset_points


def test_bisection_segments_train_the_guesses_only():
    # secret 9: 16 lower, 8 higher, 12 lower, 10 lower, 9 correct (5 guesses)
    assert bisection_segments(9) == [
        (prompt_of(), False), ("16\n", True), (LOWER, False), ("8\n", True), (HIGHER, False), ("12\n", True),
        (LOWER, False), ("10\n", True), (LOWER, False), ("9\n", True), (CORRECT, False)]


def test_encode_segments_is_the_generators_context_and_masks_the_answers():
    tok = build_tokenizer()
    segments = bisection_segments(24)  # 16 higher, 24 correct
    ids, mask = encode_segments(tok, segments)
    # the ids a generator builds: the prompt with <s>, then each turn's and answer's ids appended
    assert ids == tok(prompt_of() + "16\n" + HIGHER + "24\n" + CORRECT)["input_ids"]
    # <s> + "guess 1-31\n" (11 characters): 12 untrained; "16\n" 3 trained; "higher\n" 7 not;
    # "24\n" 3 trained; "correct\n" 8 not
    assert mask == [0] * 12 + [1] * 3 + [0] * 7 + [1] * 3 + [0] * 8
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "16\n24\n"


def test_arithmetic_warm_start_examples_are_unchanged():
    tok = build_tokenizer()
    ids, mask = encode_segments(tok, [("12+39=", False), ("15\n", True)])
    assert ids == tok("12+39=")["input_ids"] + tok("15\n", add_special_tokens=False)["input_ids"]
    assert mask == [0] * 7 + [1] * 3  # <s> and six prompt characters, then the answer and its newline


def test_reachable_held_out_secrets():
    # 16 is guessed first for every secret; 8 on the way to 4; 9 is a leaf (10 lower -> 9): no other
    # secret's search guesses it
    assert reachable([16, 8, 9], train=[4]) == [16, 8]
    assert reachable([9], train=[s for s in range(1, 32) if s != 9]) == []


def test_guess_data_keeps_the_held_out_secrets_out_of_training(tmp_path):
    demo, _ = split_demo_args(["--demo.task", "guess", "--demo.heldout", "12", "--demo.train_prompts", "500"])
    train, held, prompts, evals = guess_data(demo, tmp_path)
    assert len(held) == 12 and sorted(train + held) == list(range(1, 32))
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == 500 and {int(r["label"]) for r in rows} <= set(train)
    assert {r["prompt"] for r in rows} == {prompt_of()}
    # the evaluation plays every secret once, the held-out ones among them
    assert [int(json.loads(line)["label"]) for line in evals.read_text().splitlines()] == list(range(1, 32))
    # one test set whatever the run's seed; the training rows follow the seed
    demo2, _ = split_demo_args(["--demo.task", "guess", "--demo.heldout", "12", "--demo.seed", "1",
                                "--demo.train_prompts", "500"])
    train2, held2, prompts2, _ = guess_data(demo2, tmp_path / "seed1")
    assert held2 == held and prompts2.read_text() != prompts.read_text()


def test_subset_points_score_the_held_out_labels_of_each_round(tmp_path):
    rows = {0: [("3", 0.0), ("9", 1.0), ("12", 0.0)], 10: [("3", 1.0), ("9", 1.0), ("12", 1.0)]}
    for v, samples in rows.items():
        (tmp_path / f"version_{v}.jsonl").write_text("".join(
            json.dumps({"label": label, "reward": r}) + "\n" for label, r in samples))
    # held out 3 and 12: none of the two found at version 0, both at version 10
    assert subset_points(tmp_path, ["3", "12"]) == [(0, 0.0), (10, 1.0)]


def test_demo_args_take_the_tasks_defaults():
    demo, rest = split_demo_args(["--demo.task", "guess", "--learner.lr", "1e-4", "--demo.warm_steps=7"])
    assert demo["task"] == "guess" and demo["warm_steps"] == 7 and demo["heldout"] == 0
    assert rest == ["--learner.lr", "1e-4"]
    plain, _ = split_demo_args([])
    assert plain["task"] == "arithmetic" and plain["warm_steps"] == 375 and plain["heldout"] == 200
    with pytest.raises(SystemExit, match="not a task"):
        split_demo_args(["--demo.task", "chess"])


def test_agent_config_plays_the_game_and_counts_a_win_as_a_pass():
    from launch.run_config import load_run_config

    run = load_run_config(GUESS_CONFIG, ["--learner.model_path", str(ROOT), "--buffer.prompts", str(GUESS_CONFIG)])
    g = run.generator
    assert g.env == "guess" and "env" in run.scorer.kinds and not g.use_chat_template
    turns = g.env_args.get("max_turns", MAX_TURNS)
    assert g.max_turns == turns >= 5  # bisection over 1-31 needs 5 guesses
    assert g.max_new_tokens >= 3  # two digits and the newline
    # eval/pass@1 counts wins: the least a win scores (found on the last turn) passes, a loss (0) does not
    penalty = g.env_args.get("turn_penalty", TURN_PENALTY)
    game = Game(31, turns, penalty)
    *_, (_, least_win, done) = [game.play(f"{x}\n") for x in (16, 24, 28, 30, 31)]
    assert done and game.won and least_win >= run.eval.pass_threshold > 0
    assert run.learner.temperature == g.temperature  # log-probs comparable with the generator's


def test_calc_episodes_train_the_call_and_the_answer_and_keep_held_out_problems_out():
    from demo.calc import episode_segments, make_problems

    held = make_problems(50, seed=10_000)
    train = make_problems(500, seed=0, exclude={p["prompt"] for p in held})
    assert not {p["prompt"] for p in held} & {p["prompt"] for p in train}
    a, b = (int(x) for x in train[0]["prompt"].rstrip("=").split("*"))
    assert train[0]["label"] == str(a * b) and 10 <= min(a, b) and max(a, b) <= 99
    tok = build_tokenizer()
    ids, mask = encode_segments(tok, episode_segments({"prompt": "37*58=", "label": "2146"}))
    assert tok.decode(ids, skip_special_tokens=True) == "37*58=<calc>37*58</calc><result>2146</result>2146\n"
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<calc>37*58</calc>2146\n"  # the policy's turns


def test_calc_config_solves_a_scripted_episode_through_the_calculator():
    import asyncio

    from actors.envs.api import Row, run_episode
    from actors.envs.loader import load_env
    from launch.run_config import load_run_config

    run = load_run_config(AGENT_CONFIG, ["--learner.model_path", str(ROOT), "--buffer.prompts", str(AGENT_CONFIG)])
    g = run.generator
    assert g.env == "tools" and "env" in run.scorer.kinds and not g.use_chat_template
    assert g.max_turns >= 2 and g.max_new_tokens >= len("<calc>99*99</calc>")
    make = load_env(g.env, g.env_args, "generator.env")
    assert make().stop == ["</calc>"]  # the call's turn ends at its closing tag

    async def policy(context: str) -> str:  # the scripted episode: call, then copy the result back
        return "<calc>37*58</calc>" if "<result>" not in context else context.split("<result>")[1].split("<")[0] + "\n"

    ep = asyncio.run(run_episode(make(), Row(prompt="37*58=", label="2146"), policy, max_turns=g.max_turns,
                                 timeout_s=10.0))
    assert ep.done and ep.reward == 1.0 >= run.eval.pass_threshold
    assert run.learner.temperature == g.temperature
