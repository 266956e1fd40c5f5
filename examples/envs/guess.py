"""The guessing game (demo/guess.py) as an environment: the secret is the row's label.

Name it `guess` (its name in actors/envs/loader.py's NAMED_ENVS) or `examples/envs/guess.py:GuessEnv`
wherever an environment is named (`actors.envs.loader.load_env`); its arguments (`max_turns`,
`turn_penalty`) are the environment's kwargs. It is written as any environment file is: a class
with `reset(row)` and `step(action)`, one instance per episode. The class lives here rather than in
actors/ because actors/ does not import demo/, and a file loaded by path is what users write.
"""

from actors.envs.api import Environment, Row, StepResult
from demo.guess import MAX_TURNS, TURN_PENALTY, Game


class GuessEnv(Environment):
    observation_role = "user"  # with a chat template, each answer is a user message

    def __init__(self, max_turns: int = MAX_TURNS, turn_penalty: float = TURN_PENALTY):
        self.max_turns, self.turn_penalty = max_turns, turn_penalty
        self.game: Game | None = None

    async def reset(self, row: Row) -> None:
        if row.label is None or not row.label.strip().isdigit():
            raise ValueError(f"the row's label {row.label!r} is not a secret number")
        self.game = Game(int(row.label), self.max_turns, self.turn_penalty)
        return None  # the prompt as it is: "guess 1-31\n"

    async def step(self, action: str) -> StepResult:
        answer, reward, done = self.game.play(action)
        return StepResult(answer, reward, done, {"won": self.game.won, "turns": self.game.turns})
