"""The tools demo's task: two-digit multiplication, which the policy answers with the calculator.

One episode as the policy sees it (the policy writes the call and the answer, the calculator the
result; `</calc>` ends the call's turn, a newline the answer's):

    37*58=                    the prompt
    <calc>37*58</calc>        the policy's call        (turn 1, trained)
    <result>2146</result>     the tool's answer        (the environment's: masked out of the loss)
    2146\\n                    the policy's answer      (turn 2, trained): reward 1 if it is the product

A product of two two-digit numbers is out of reach of a tiny model's arithmetic, so without the
tool's answer the policy scores about 0: what it must learn is to pass the question to the tool
exactly and copy the result back, which carries over to problems it never trained on. So the
held-out set is simply other problems (`make_problems` with `exclude`).

The environment is actors/envs/tool_env.py's `tools` with the calculator in the tags format (the
character tokenizer has no chat template); `episode_segments` is a scripted episode for the
supervised warm start (`demo.arithmetic.warm_start_segments`), its loss on the policy's turns only.
"""

from __future__ import annotations

import random

LO, HI = 10, 99  # the operands' range


def make_problems(n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct problems `{"prompt": "a*b=", "label": str(a*b)}`, none of them in `exclude`."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    span = HI - LO + 1
    if n > span * span - len(seen):
        raise ValueError(f"only {span * span - len(seen)} distinct problems are left, asked for {n}")
    out = []
    while len(out) < n:
        a, b = rng.randint(LO, HI), rng.randint(LO, HI)
        prompt = f"{a}*{b}="
        if prompt not in seen:
            seen.add(prompt)
            out.append({"prompt": prompt, "label": str(a * b)})
    return out


def episode_segments(problem: dict) -> list[tuple[str, bool]]:
    """The scripted episode of a problem as `(text, trained)` segments, the prompt first."""
    expression = problem["prompt"].rstrip("=")
    return [(problem["prompt"], False), (f"<calc>{expression}</calc>", True),
            (f"<result>{problem['label']}</result>", False), (problem["label"] + "\n", True)]
