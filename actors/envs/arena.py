"""Environments from existing libraries, through adapters: TextArena's games (textarena 0.7.4).

TextArena (`pip install textarena==0.7.4`) holds about a hundred text games (700 ids with their
variants), played turn by turn, offline, through a gym-like API. Its single-player games
(GuessTheNumber, Mastermind, Sudoku, Minesweeper, Crosswords, FrozenLake, TowerOfHanoi, Sokoban,
2048, ...; 24 of the `-v0` ids load offline) map onto Conveyor's reset/step:

    load_env("textarena:GuessTheNumber-v0", {"max_number": 100})   # generator.env / generator.env_args

    reset(row)       env = ta.make(id, **env_args); env.reset(num_players=1, seed=SEED)
                     -> the opening: the game's first messages (its rules), which replace the prompt
    step(action)     done, info = env.step(action); then the messages the game added since the
                     policy's last turn; at the end: rewards, game_info = env.close()

Observations are deltas: the messages the game wrote to the policy's player since its last turn,
each as TextArena's `LLMObservationWrapper` writes it ("\\n[GAME] The target number is higher."),
minus the echo of the policy's own action (already in the context). The context then reads as the
wrapper's full history would, but nothing is repeated turn after turn. So the id's observation
wrappers (`LLMObservationWrapper` and the like, which rebuild the whole history every turn) are
bypassed: messages are read from the innermost game. The id's action wrappers apply: the
default ids' `ActionFormattingWrapper` puts an action that has no brackets in them (`7` -> `[7]`,
the form most games parse); the `-raw` ids pass the text as it is. A game's own parsing of the
action (GuessTheNumber reads the first `[number]`) decides what counts; an invalid move comes back
as the game's "[GAME] You attempted an invalid move ..." message, and the game's error allowance
decides when it ends the episode.

Reward, on the step that ends the game (other steps give 0): `reward="game"` (the default) is
TextArena's reward for the policy's player as the game gives it (1 for a win; many single-player
games give partial credit for a loss, e.g. GuessTheNumber's closeness of the last guess, or a
penalty for an invalid move); `reward="win"` is 1.0 when that reward is 1 (TextArena's mark of a
win) and 0.0 otherwise. An episode cut by `generator.max_turns` before the game ends scores 0.
The last step's info holds TextArena's `game_info` for the player (`reason`, `invalid_move`,
`turn_count`) and its raw `textarena_reward`.

Seeds come from the row, so a row is one reproducible game: the label when it is an integer
("17"), else the row's index in the prompt dataset. A prompt file for a game is thus a list of
seeds (the prompt text itself is replaced by the game's opening). TextArena seeds Python's global
`random` (and a few games numpy's); every call into a game here runs under one lock with the
episode's own generator states swapped in, so concurrent episodes neither disturb each other's
draws nor the process's.

Every key of env_args goes to `ta.make` (the game's constructor) except `reward`. Refused at load,
with the reason: textarena not installed, an unknown id (with close ids), arguments the game does
not take, a game of several players (its reset refuses one player, or plays more: the other seats
would have no one to play them), a game that cannot be made or reset offline (one that needs
NLTK's word lists, an API key, or a file the package does not ship). A game that raises
mid-episode fails that episode (an `EnvFailure` from `run_step`), as any environment does; in
0.7.4 a few (Countdown, Cryptarithm, Slitherlink, ThreeCardMonte) raise at a second invalid move.
"""

from __future__ import annotations

import contextlib
import difflib
import random
import re
import threading
from typing import Any, Callable

from actors.envs.api import EnvLoadError, Row, StepResult

INSTALL = "pip install textarena==0.7.4"
REWARDS = ("game", "win")
LOCK_WAIT_S = 60.0  # a call into a game waits this long for another's to finish (they take microseconds)

_random_lock = threading.Lock()  # TextArena's randomness is process-global: one game call at a time


def textarena_env(game_id: str, kwargs: dict | None, where: str) -> Callable[[], TextArenaEnv]:
    """A factory of fresh TextArenaEnv episodes of `game_id`; checks everything it can at once
    (one trial game is made and reset), so a bad spec fails at load, quoting `where`."""
    try:
        import textarena as ta
    except ImportError as e:
        raise EnvLoadError(f"{where}: textarena is not installed ({e}); {INSTALL}") from None
    kwargs = dict(kwargs or {})
    reward = kwargs.pop("reward", "game")
    if reward not in REWARDS:
        raise EnvLoadError(f"{where}: reward={reward!r}; expected one of {list(REWARDS)}")
    registry = ta.envs.registration.ENV_REGISTRY
    if game_id not in registry:
        close = difflib.get_close_matches(game_id, registry, n=6, cutoff=0.5)
        same = sorted(k for k in registry if k.split("-")[0].lower() == game_id.split("-")[0].lower())
        hint = sorted(set(close) | set(same[:6])) or sorted(k for k in registry if k.endswith("-v0"))[:8]
        raise EnvLoadError(f"{where}: textarena has no game {game_id!r} ({len(registry)} ids); "
                           f"close ones: {', '.join(hint)}")
    trial = TextArenaEnv(game_id, kwargs, reward)
    try:
        trial.make()
    except Exception as e:
        raise EnvLoadError(f"{where}: textarena.make({game_id!r}, **{kwargs}) raised {type(e).__name__}: "
                           f"{_first_line(e)}") from None
    try:
        trial.reset(Row(prompt="", index=0))
    except Exception as e:
        # (games refuse one player in their own words: "The number of players has to be 2", "2 ≤ players ≤ 15")
        if isinstance(e, NotSinglePlayer) or (isinstance(e, (AssertionError, ValueError)) and "player" in str(e)):
            raise EnvLoadError(f"{where}: {game_id} is not a single-player game ({_first_line(e)}); only single-"
                               "player games are supported: other seats would have no one to play them") from None
        raise EnvLoadError(f"{where}: a trial reset of {game_id} failed: {type(e).__name__}: "
                           f"{_first_line(e)}") from None
    return lambda: TextArenaEnv(game_id, kwargs, reward)


class TextArenaEnv:
    """One episode of a single-player TextArena game (see the module docstring). Its methods are
    plain functions: the environment runner calls them in threads of their own."""

    observation_role = "user"  # the game speaks as the user does

    def __init__(self, game_id: str, kwargs: dict[str, Any], reward: str = "game"):
        self.game_id, self.kwargs, self.reward_mode = game_id, kwargs, reward
        self.env = None  # the wrapped game, as ta.make returns it
        self.game = None  # the innermost game: its messages are read from here, not from wrappers
        self._random: tuple | None = None  # this episode's generator states between calls

    def make(self) -> None:
        import textarena as ta

        self.env = ta.make(self.game_id, **self.kwargs)
        self.game = self.env
        while isinstance(self.game, ta.Wrapper):
            self.game = self.game.env

    def reset(self, row: Row) -> str:
        self.make()
        seed = seed_of(row)
        with self._own_random(seed):
            self.env.reset(num_players=1, seed=seed)
        players = self.game.state.num_players
        if players != 1:  # (some games take num_players=1 and play their own count)
            raise NotSinglePlayer(f"it was reset for {players} players")
        return self._messages().lstrip("\n")

    def step(self, action: str) -> StepResult:
        with self._own_random():
            done, info = self.env.step(action)
            observation = self._messages()
            if not done:
                return StepResult(observation, 0.0, False, dict(info or {}))
            rewards, game_info = self.env.close()
        raw = (rewards or {}).get(0)
        info = {**dict(info or {}), **dict((game_info or {}).get(0, {})), "textarena_reward": raw}
        return StepResult(observation, self._reward(raw), True, info)

    def _reward(self, raw) -> float:
        if raw is None:  # the game ended without rewards (none of the shipped single-player games does)
            return 0.0
        return float(raw) if self.reward_mode == "game" else float(raw == 1)

    def _messages(self) -> str:
        """The messages the game wrote the policy's player since its last turn, as text."""
        player, messages = self.game.get_observation()
        if player != 0:
            raise NotSinglePlayer(f"{self.game_id} gave the turn to player {player}, not to the policy's 0")
        roles = self.game.state.role_mapping
        # Left out: the policy's own action, and entries not shaped (sender id, text, type): a few games
        # (Countdown, Cryptarithm, Slitherlink) pass add_observation's arguments in the wrong order
        # for their action echo.
        return "".join(f"\n[{'GAME' if sender < 0 else roles.get(sender, f'Player {sender}')}] {message}"
                       for sender, message, kind in messages
                       if isinstance(sender, int) and isinstance(message, str) and hasattr(kind, "name")
                       and not (sender == player and kind.name == "PLAYER_ACTION"))

    @contextlib.contextmanager
    def _own_random(self, seed: int | None = None):
        """Run a game call with this episode's random generators in place of the process's (seeded
        from `seed` when given: reset; TextArena seeds `random` again itself, numpy it does not)."""
        import numpy as np

        if not _random_lock.acquire(timeout=LOCK_WAIT_S):
            raise TimeoutError(f"another textarena game call has held the random lock for {LOCK_WAIT_S:g} s")
        outer = random.getstate(), np.random.get_state()
        try:
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
            elif self._random is not None:
                random.setstate(self._random[0])
                np.random.set_state(self._random[1])
            yield
        finally:
            self._random = random.getstate(), np.random.get_state()
            random.setstate(outer[0])
            np.random.set_state(outer[1])
            _random_lock.release()


class NotSinglePlayer(RuntimeError):
    """A game that plays more than the policy's one seat."""


def seed_of(row: Row) -> int:
    """The game's seed: the row's label when it is an integer, else the row's index."""
    label = (row.label or "").strip()
    return int(label) if re.fullmatch(r"-?\d+", label) else row.index


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not set(line.strip()) <= set("*")]
    return lines[0][:300] if lines else type(e).__name__
