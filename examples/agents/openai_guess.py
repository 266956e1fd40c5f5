"""An agent written against the `openai` client: it plays demo/guess.py's game through the generator.

    generator:                  # e.g. examples/guess.yaml with these in place of its `env:` lines
      agent: examples/agents/openai_guess.py:agent
      agent_args: {max_turns: 5}
      stop_token_ids: [88]      # "\\n" in the tiny tokenizer: a guess is one line

The generator calls `agent(base_url, row)` once per sample, `base_url` naming that sample's
session of its OpenAI-compatible endpoint (actors/agents/openai_server.py). Nothing here knows about
Conveyor's token ids: the agent sends plain completions requests, keeps the game's state itself,
and returns the reward; the generator records the ids it sampled and the ids of the game's
answers, and makes the session one rollout. The same agent runs against any OpenAI-compatible
server (`base_url` and `api_key` are all it takes).
"""

from __future__ import annotations

import openai

from demo.guess import MAX_TURNS, Game


async def agent(base_url: str, row, max_turns: int = MAX_TURNS, max_tokens: int = 3) -> float:
    """One game against the row's secret (its label); the reward is the game's (0 unless won)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    game, prompt, reward = Game(int(row.label), max_turns), row.prompt, 0.0
    try:
        while not game.over:
            out = await client.completions.create(model="policy", prompt=prompt, max_tokens=max_tokens)
            guess = out.choices[0].text
            answer, reward, _ = game.play(guess)
            prompt += guess + answer  # the next request extends this one: the server encodes only `answer`
    finally:
        await client.close()
    return reward
