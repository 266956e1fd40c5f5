"""TextArena's games through the adapter (actors/envs/arena.py), played with the real textarena 0.7.4.

Episodes run as the generator runs them, through actors.envs.api's run_reset/run_step (run_episode),
with scripted policies in place of a model; everything is offline and takes well under a second.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys

import pytest

ta = pytest.importorskip("textarena")

from actors.envs.api import EnvFailure, EnvLoadError, Row, run_episode, run_reset, run_step  # noqa: E402
from actors.envs.loader import load_env  # noqa: E402

GUESS = "textarena:GuessTheNumber-v0"
HINT = re.compile(r"\[(\d+)\]\n\[GAME\] The target number is (higher|lower)\.")


async def bisection(context: str) -> str:
    """Guess the middle of what the game's answers so far leave open (read back from the context)."""
    lo, hi = (int(x) for x in re.search(r"between (\d+) and (\d+)", context).groups())
    for guess, hint in HINT.findall(context):
        lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
    return f"[{(lo + hi) // 2}]"


def play(env, row, policy=bisection, max_turns=10):
    return asyncio.run(run_episode(env, row, policy, max_turns=max_turns, timeout_s=5.0))


def test_bisection_wins_guess_the_number_and_the_context_grows_by_deltas():
    make = load_env(GUESS, {"max_number": 100, "max_turns": 10}, "generator.env")
    outer = random.getstate()
    for seed in range(6):
        env = make()
        ep = play(env, Row(prompt="game", label=str(seed)))
        secret = env.game.game_number  # drawn from the row's seed
        # 100 values: bisection needs at most 7 guesses; the last is the secret; TextArena's reward for a win is 1
        assert ep.failure is None and ep.done and ep.turns <= 7 and ep.reward == 1.0, (seed, ep)
        assert ep.context.endswith(f"[{secret}]") and "Congratulations" in ep.info["reason"]
        assert ep.info["textarena_reward"] == 1 and ep.info["invalid_move"] is False
        # the opening (the rules) once, then per turn the action and only the game's new message
        opening, rest = ep.context.split("Enter your guess.", 1)
        assert opening.startswith("[GAME] You are Player 0. You are playing Guess The Number.")
        assert "between 1 and 100 within 10 turns" in opening and "You are Player" not in rest
        hints = "".join(f"[{g}]\n[GAME] The target number is {h}." for g, h in HINT.findall(rest))
        assert rest == hints + f"[{secret}]"
    assert random.getstate() == outer  # the games' seeding left the process's generator alone


def test_a_row_is_one_reproducible_game_even_with_episodes_in_flight_together():
    make = load_env(GUESS, {"max_number": 1000, "max_turns": 12}, "generator.env")
    rows = [Row(prompt="game", label=str(seed)) for seed in (3, 4, 5)] + [Row(prompt="game", index=9)]

    async def together():
        return await asyncio.gather(*(run_episode(make(), row, bisection, max_turns=12, timeout_s=5.0)
                                      for row in rows * 3))

    alone = [play(make(), row, max_turns=12).context for row in rows]
    assert [ep.context for ep in asyncio.run(together())] == alone * 3
    assert len(set(alone)) == len(rows)  # seeds 3, 4, 5 and (no integer label) the row's index 9 differ
    assert play(make(), Row(prompt="game", label="9"), max_turns=12).context == alone[3]


def test_rewards_game_and_win_and_invalid_moves():
    async def low(context: str) -> str:
        return f"[{len(HINT.findall(context)) + 1}]"  # 1, 2, ...: far below the secret

    row = Row(prompt="game", label="1")
    game = load_env(GUESS, {"min_number": 1, "max_number": 100, "max_turns": 2})()
    ep = play(game, row, low)
    secret = game.game.game_number
    # (TextArena checks its limit before counting the turn: max_turns 2 ends the game at the third guess)
    assert secret > 3 and ep.done and ep.turns == 3
    # the game's reward at its turn limit: its closeness of the last guess, 1 - |3 - secret| / (100 - 1)
    assert ep.reward == pytest.approx(1 - (secret - 3) / 99) and "turn limit" in ep.info["reason"]
    ep = play(load_env(GUESS, {"max_number": 100, "max_turns": 2, "reward": "win"})(), row, low)
    assert ep.done and ep.reward == 0.0 and ep.info["textarena_reward"] == pytest.approx(1 - (secret - 3) / 99)

    env = load_env(GUESS, {"max_number": 100})()
    asyncio.run(run_reset(env, row, 1.0))
    # "seven" has no [number]: the game says so and allows one error; the id's ActionFormattingWrapper makes "7" "[7]"
    step = asyncio.run(run_step(env, "seven", 1.0))
    assert not step.done
    assert step.observation.startswith("\n[GAME] You attempted an invalid move. Reason: Invalid move format.")
    step = asyncio.run(run_step(env, "7", 1.0))
    assert not step.done and step.observation == "\n[GAME] The target number is higher."


class Breaks(ta.Env):
    """A real TextArena game (one player) whose second move raises."""

    def reset(self, num_players, seed=None):
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=5)
        self.state.reset(game_state={}, player_prompt_function=lambda player_id, game_state: "Say anything.")

    def step(self, action):
        if self.state.turn >= 1:
            raise RuntimeError("the board caught fire")
        self.state.add_observation(message="Go on.", observation_type=ta.ObservationType.GAME_MESSAGE)
        return self.state.step()


def test_a_game_that_raises_mid_episode_fails_that_episode():
    if "ConveyorBreaks-v0" not in ta.envs.registration.ENV_REGISTRY:
        ta.register(id="ConveyorBreaks-v0", entry_point=Breaks)
    env = load_env("textarena:ConveyorBreaks-v0")()
    assert asyncio.run(run_reset(env, Row(prompt=""), 1.0)) == "[GAME] Say anything."
    assert asyncio.run(run_step(env, "hi", 1.0)).observation == "\n[GAME] Go on."
    failed = asyncio.run(run_step(env, "hi", 1.0))
    assert failed == EnvFailure("raised", "TextArenaEnv.step raised RuntimeError: the board caught fire")


@pytest.mark.parametrize("spec, kwargs, why", [
    ("textarena:GuessTheNumbr-v0", {}, r"textarena has no game 'GuessTheNumbr-v0' \(\d+ ids\); close ones: "
                                       r"GuessTheNumber-v0, GuessTheNumber-v0-hardcore"),
    ("textarena:TicTacToe-v0", {}, r"TicTacToe-v0 is not a single-player game \(The number of players has to be 2"),
    (GUESS, {"max_numbr": 5}, r"textarena.make\('GuessTheNumber-v0', \*\*\{'max_numbr': 5\}\) raised TypeError"),
    (GUESS, {"reward": "won"}, r"reward='won'; expected one of \['game', 'win'\]"),
])
def test_bad_specs_are_refused_at_load(spec, kwargs, why):
    with pytest.raises(EnvLoadError, match=re.escape(f"generator.env={spec!r}: ") + why):
        load_env(spec, kwargs, "generator.env")


def test_without_textarena_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # what an interpreter without the package sees
    with pytest.raises(EnvLoadError, match=r"textarena is not installed .*; pip install textarena==0\.7\.4"):
        load_env(GUESS)


def test_the_example_config_plays_its_game(tmp_path):
    from launch.run_config import load_run_config

    run = load_run_config("examples/envs/textarena_guess.yaml", ["--learner.model_path", str(tmp_path)])
    g = run.generator
    assert run.scorer.kinds == ["env"]  # the game's reward is the episode's
    ep = play(load_env(g.env, g.env_args, "generator.env")(), Row(prompt="game 3", label="3"), max_turns=g.max_turns)
    assert ep.done and ep.reward == 1.0 and "between 1 and 50" in ep.context  # 50 values: 6 guesses at most
