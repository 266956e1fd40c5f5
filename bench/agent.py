"""Multi-turn episodes through the generator's episode loop: a tool that sleeps against an instant one.

    python bench/agent.py [--episodes 256] [--turns 3] [--tokens 16] [--tool-ms 100] [--repeats 2]

One vLLM engine (CPU build, the tiny model, fp32) in this process plays `--episodes` episodes at
once (`actors.envs.episodes.run_episodes`, as a generator plays a lease's), each `--turns` policy turns
of `--tokens` tokens against an environment whose every step takes `--tool-ms` (asleep, as an
environment waiting on a tool or a sandbox does), then the same episodes against an instant one,
alternating, `--repeats` times. Episodes/s of each and their ratio (goal >= 0.8): the sleeping
steps overlap with each other and with the engine's batches, so they cost what the engine is idle
for, not their sum. Progress on stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Tool:
    """Answers after `delay_s` each turn; the episode ends after `turns` turns."""

    def __init__(self, delay_s: float, turns: int):
        self.delay_s, self.turns, self.turn = delay_s, turns, 0

    async def reset(self, row):
        return None

    async def step(self, action):
        self.turn += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return (" ok.", 0.0, self.turn >= self.turns, {})


FLAGS = {  # flag: (type, default, help)
    "--episodes": (int, 256, "episodes per measurement, all in flight at once"),
    "--turns": (int, 3, "policy turns per episode"),
    "--tokens": (int, 16, "tokens per policy turn"),
    "--tool-ms": (float, 100.0, "how long the environment takes to answer a turn"),
    "--repeats": (int, 2, "measurements of each mode (the best is kept)"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, (kind, default, what) in FLAGS.items():
        ap.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
    args = ap.parse_args()

    from actors.config import GeneratorConfig
    from actors.engines import VLLMEngine
    from actors.engines.base import Sampling
    from actors.envs.episodes import run_episodes
    from buffer.messages import PromptGroup
    from demo.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench_agent_")) / "tiny", seed=0)
    engine = VLLMEngine(str(model), dtype="float32", seed=0)
    cfg = GeneratorConfig(model=str(model), max_turns=args.turns + 1, max_new_tokens=args.tokens,
                          use_chat_template=False, env_timeout_s=60.0)
    sampling = Sampling(temperature=1.0, max_tokens=args.tokens)
    groups = [PromptGroup(i, f"{i % 90 + 10}+{i % 7}=", None) for i in range(args.episodes // 4)]
    prompts = [engine.tokenizer.encode(g.prompt) for g in groups]

    def generate(contexts, turn):
        return [c[0] for c in engine.generate(contexts, 1, turn)]

    def run(delay_s: float) -> tuple[float, int]:
        counts = Counter()
        t0 = time.monotonic()
        played = run_episodes(groups, prompts, 4, engine, sampling, cfg, lambda: Tool(delay_s, args.turns), generate,
                              counts)
        dt = time.monotonic() - t0
        n = sum(len(e) for e in played.values())
        assert all(x.finish == "stop" for e in played.values() for x in e), "an episode did not finish"
        return n / dt, counts["engine_batches"]

    run(0.0)  # warm-up
    rows = {"tool": [], "instant": []}
    for r in range(args.repeats):
        for name, delay in (("tool", args.tool_ms / 1000), ("instant", 0.0)):
            eps, batches = run(delay)
            rows[name].append(eps)
            print(f"[bench] {name:7s} repeat {r}: {eps:.1f} episodes/s ({batches} engine batches)", file=sys.stderr)
    engine.close()
    tool, instant = max(rows["tool"]), max(rows["instant"])
    print(json.dumps({"episodes_per_s_tool": round(tool, 2), "episodes_per_s_instant": round(instant, 2),
                      "ratio": round(tool / instant, 3), "episodes": args.episodes, "turns": args.turns,
                      "tokens_per_turn": args.tokens, "tool_ms": args.tool_ms}))


if __name__ == "__main__":
    main()
