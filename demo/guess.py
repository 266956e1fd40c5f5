"""The agent demo's task: find a secret number, told "higher" or "lower" after each guess.

One episode as the policy sees it (the policy writes the guesses, the game the answers; every
turn ends with a newline, so "\\n" is the policy's stop token):

    guess 1-31\\n        the prompt (the same for every row: it names the range only)
    16\\n   lower\\n      a guess, the game's answer
    8\\n    higher\\n
    12\\n   correct\\n    found in 3 guesses: reward 1 - 2 * 0.05 = 0.9

The secret is the row's label and the prompt does not depend on it, so a policy that ignores the
answers can only win by luck: the environment's answer is what makes the task learnable.
Bisection finds any secret of 1-31 within 5 guesses (31 = 2**5 - 1), so a limit of 5 turns
leaves no slack for a policy that does not narrow the range. A turn that is not a number gets
"invalid" and still counts; an episode that runs out of turns scores 0.

`best_guess` is bisection (scripted policies, the supervised warm start's targets: `bisection_turns`,
`bisection_segments`); `make_problems` draws rows like `demo.arithmetic.make_problems`;
`split_secrets` keeps some secrets out of training. A policy that searches the whole range finds
held-out secrets; one that has learnt a search tailored to the training secrets does not (a turn
penalty pays for tailoring: fewer guesses for the training secrets). A held-out secret that
bisection guesses on the way to a training secret (`reachable`) is found by a policy that follows
bisection wherever training took it; a held-out leaf of bisection's tree (guessed for no other
secret) needs the midpoint worked out rather than recalled, which the tiny model does not learn.
So the guessing demo (`python -m launch.demo --demo.task guess`) trains on every secret and evaluates
greedy play on each; `--demo.heldout N` holds N out and plots their success beside it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LO, HI = 1, 31  # the default range
MAX_TURNS = 5  # enough for bisection over 1-31, and no more
TURN_PENALTY = 0.05  # taken off a win's reward per guess after the first
HIGHER, LOWER, CORRECT, INVALID = "higher\n", "lower\n", "correct\n", "invalid\n"


def prompt_of(lo: int = LO, hi: int = HI) -> str:
    return f"guess {lo}-{hi}\n"


def parse_guess(action: str) -> int | None:
    """The number a turn guesses: its text up to the first newline or eos, else None."""
    text = action.split("\n", 1)[0].split("</s>", 1)[0].strip()
    return int(text) if text.isdigit() else None


@dataclass
class Game:
    """One episode of the game; `play` answers one turn."""

    secret: int
    max_turns: int = MAX_TURNS
    turn_penalty: float = TURN_PENALTY
    turns: int = 0
    won: bool = False

    @property
    def over(self) -> bool:
        return self.won or self.turns >= self.max_turns

    def play(self, action: str) -> tuple[str, float, bool]:
        """(answer, reward, done) for one turn's text; the reward is nonzero only on a win."""
        if self.over:
            raise ValueError(f"the game is over (won={self.won}, turns={self.turns}/{self.max_turns})")
        self.turns += 1
        guess = parse_guess(action)
        if guess == self.secret:
            self.won = True
            return CORRECT, 1.0 - self.turn_penalty * (self.turns - 1), True
        answer = INVALID if guess is None else HIGHER if guess < self.secret else LOWER
        return answer, 0.0, self.over


def best_guess(history: list[tuple[int | None, str]], lo: int = LO, hi: int = HI) -> int:
    """Bisection: the middle of what the (guess, answer) pairs so far leave of lo..hi."""
    for guess, answer in history:
        if guess is None:
            continue
        if answer == HIGHER:
            lo = max(lo, guess + 1)
        elif answer == LOWER:
            hi = min(hi, guess - 1)
    return (lo + hi) // 2


def history_of(context: str) -> list[tuple[int | None, str]]:
    """The (guess, answer) pairs of an episode's text so far (prompt first, as in the docstring)."""
    lines = context.split("\n")[1:-1]  # the prompt's line off the front, the open turn off the end
    return [(parse_guess(lines[i]), lines[i + 1] + "\n") for i in range(0, len(lines) - 1, 2)]


def bisection_policy(context: str, lo: int = LO, hi: int = HI) -> str:
    """The next turn's text of bisection, read from the episode's text so far."""
    return f"{best_guess(history_of(context), lo, hi)}\n"


def bisection_turns(secret: int, lo: int = LO, hi: int = HI, max_turns: int = MAX_TURNS) -> list[tuple[str, str]]:
    """The (guess, answer) texts of bisection's episode for `secret`, e.g. [("16\\n", "lower\\n"), ...]:
    supervised targets for a warm start (loss on the guesses only)."""
    game, history, turns = Game(secret, max_turns), [], []
    while not game.over:
        guess = best_guess(history, lo, hi)
        answer, _, _ = game.play(f"{guess}\n")
        history.append((guess, answer))
        turns.append((f"{guess}\n", answer))
    return turns


def split_secrets(n_held_out: int, seed: int, lo: int = LO, hi: int = HI) -> tuple[list[int], list[int]]:
    """(training secrets, held-out secrets): `n_held_out` of lo..hi drawn at random, kept out of training."""
    secrets = list(range(lo, hi + 1))
    if not 0 <= n_held_out < len(secrets):
        raise ValueError(f"n_held_out={n_held_out}: the range {lo}-{hi} holds {len(secrets)} secrets")
    held = sorted(random.Random(seed).sample(secrets, n_held_out))
    return [s for s in secrets if s not in held], held


def make_problems(n: int, seed: int, secrets: list[int] | None = None, lo: int = LO, hi: int = HI) -> list[dict]:
    """`n` rows `{"prompt": "guess lo-hi\\n", "label": "<secret>"}`, secrets drawn uniformly from
    `secrets` (default: all of lo..hi). The range holds few secrets, so rows repeat them."""
    pool = list(range(lo, hi + 1)) if secrets is None else list(secrets)
    if not pool or any(not lo <= s <= hi for s in pool):
        raise ValueError(f"secrets={pool!r} must be a non-empty list within {lo}-{hi}")
    rng = random.Random(seed)
    return [{"prompt": prompt_of(lo, hi), "label": str(rng.choice(pool))} for _ in range(n)]


def bisection_segments(secret: int, lo: int = LO, hi: int = HI, max_turns: int = MAX_TURNS) -> list[tuple[str, bool]]:
    """Bisection's episode for `secret` as `(text, trained)` segments, the prompt first: the warm
    start's example (`demo.arithmetic.warm_start_segments`), the loss on the guesses only."""
    segments = [(prompt_of(lo, hi), False)]
    for guess, answer in bisection_turns(secret, lo, hi, max_turns):
        segments += [(guess, True), (answer, False)]
    return segments


def reachable(held_out: list[int], train: list[int], lo: int = LO, hi: int = HI) -> list[int]:
    """The held-out secrets that bisection guesses on the way to some training secret: the policy
    meets their last turn's context in training. The others (bisection's leaves, found by no other
    secret's search) are found only by a policy that computes the midpoint rather than recalls it."""
    guessed = {int(g) for s in train for g, _ in bisection_turns(s, lo, hi)}
    return [s for s in held_out if s in guessed]
