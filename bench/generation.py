"""Generation throughput: the vLLM backend against the transformers backend, same model, same prompts.

    python bench/generation.py [--prompts 32] [--n 4] [--max-tokens 64] [--models tiny,large] [--repeat 3]
                               [--cpu-linear auto,packed]

Models are built on the fly (demo/tiny_model.py): `tiny` (2 layers, hidden 128) and `large`
(8 layers, hidden 512), or given as folders. vLLM runs as a generator builds it, once per
`--cpu-linear` setting (on CPU: `auto` = torch's linear on plain float32 weights, which a weight
round copies into; `packed` = vLLM's oneDNN kernels on repacked weights, which a round repacks). \
Each engine gets one untimed warm-up call, then `--repeat` timed
`generate` calls of n samples for every prompt at temperature 1; the fastest is reported (the
machine may be shared), with all of them alongside. Generated tokens are counted from the outputs (both
backends stop at eos). Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # first, even when PYTHONPATH has it: bench/weight_sync.py would shadow the package

MODELS = {"tiny": dict(num_layers=2, hidden_size=128), "large": dict(num_layers=8, hidden_size=512)}


def say(msg: str) -> None:
    print(f"[bench/generation] {msg}", file=sys.stderr, flush=True)


def bench_engine(kind: str, model_dir: str, prompt_ids: list[list[int]], n: int, max_tokens: int, seed: int,
                 repeat: int, cpu_linear: str = "auto") -> dict:
    from actors.engines import TransformersEngine, VLLMEngine
    from actors.engines.base import Sampling

    t0 = time.perf_counter()
    if kind == "vllm":
        # as a generator builds it (its worker extension applies generator.cpu_linear on CPU)
        engine = VLLMEngine(model_dir, dtype="float32", seed=seed, cpu_linear=cpu_linear)
    else:
        engine = TransformersEngine(model_dir, dtype="float32", seed=seed)
    startup_s = time.perf_counter() - t0
    runs = []  # (tokens, seconds) per timed run
    try:
        engine.generate(prompt_ids[:2], 1, Sampling(temperature=1.0, max_tokens=8))  # warm-up
        for _ in range(repeat):
            t0 = time.perf_counter()
            # No per-request seed: vLLM would give every request the same random stream, and samples
            # of different prompts would come out correlated (the engines are seeded as a whole).
            groups = engine.generate(prompt_ids, n, Sampling(temperature=1.0, max_tokens=max_tokens))
            runs.append((sum(len(c.token_ids) for g in groups for c in g), time.perf_counter() - t0))
    finally:
        engine.close()
    rates = [t / s for t, s in runs]
    best = max(range(len(runs)), key=lambda i: rates[i])  # the least disturbed run on a shared machine
    return {"engine": kind, "startup_s": round(startup_s, 2), "tokens": runs[best][0],
            "seconds": round(runs[best][1], 3), "sequences": len(prompt_ids) * n,
            "tokens_per_s": round(rates[best], 1), "all_tokens_per_s": [round(r, 1) for r in rates]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="longest completion")
    p.add_argument("--models", default="tiny,large",
                   help=f"comma-separated, of {list(MODELS)}, or model folders (e.g. a ~1B Llama built beforehand)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per engine; the fastest is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-linear", default="auto,packed", help="vLLM's CPU linear kernels to run, comma-separated, "
                   "of auto (a generator's default: plain for float32), plain, packed (vLLM's oneDNN default)")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep stderr to the progress lines

    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from demo.arithmetic import make_problems
    from demo.tiny_model import build_tiny_model

    prompts = [row["prompt"] for row in make_problems(a.prompts, seed=a.seed)]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_generation_") as tmp:
        for name in a.models.split(","):
            if name in MODELS:
                model_dir = str(build_tiny_model(Path(tmp) / name, **MODELS[name], seed=a.seed))
            elif (Path(name) / "config.json").is_file():
                model_dir = name
            else:
                p.error(f"--models: {name!r} is neither one of {list(MODELS)} nor a model folder")
            tok = AutoTokenizer.from_pretrained(model_dir)
            prompt_ids = [tok.encode(q) for q in prompts]
            n_params = sum(t.numel() for t in load_file(str(Path(model_dir) / "model.safetensors")).values())
            runs = [("vllm", c) for c in a.cpu_linear.split(",")] + [("transformers", "")]
            for kind, cpu_linear in runs:
                say(f"{name} ({n_params / 1e6:.1f}M params), {kind} {cpu_linear}: {len(prompts)} prompts x {a.n} "
                    f"samples, up to {a.max_tokens} tokens")
                r = {"model": name, **MODELS.get(name, {}), "params": n_params, "cpu_linear": cpu_linear,
                     **bench_engine(kind, model_dir, prompt_ids, a.n, a.max_tokens, a.seed, a.repeat,
                                    cpu_linear or "auto")}
                say(f"  best of {a.repeat}: {r['tokens']} tokens in {r['seconds']:.2f}s: {r['tokens_per_s']:.0f} tok/s "
                    f"(all runs {r['all_tokens_per_s']}; engine start {r['startup_s']:.1f}s)")
                results.append(r)
    speedup = {}
    for name in a.models.split(","):
        by = {(r["engine"], r["cpu_linear"]): r["tokens_per_s"] for r in results if r["model"] == name}
        speedup[name] = {c or "transformers": round(v / by[("transformers", "")], 2) for (_, c), v in by.items()}
    out = {"bench": "generation", "torch_threads": torch.get_num_threads(), "prompts": a.prompts, "n": a.n,
           "max_tokens": a.max_tokens, "repeat": a.repeat, "results": results, "vllm_speedup": speedup}
    print(json.dumps(out))


if __name__ == "__main__":  # vLLM spawns its engine process: this guard is required
    main()
