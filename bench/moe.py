"""Mixture of experts: train/inference mismatch with routing replay off and on, and the learner's
throughput of the tiny Qwen3-MoE against the dense Llama of the same active size, in one run.

    .venv/bin/python bench/moe.py [--steps 12] [--warm-steps 500] [--out runs/bench_moe] [--quick] [--learn]
                                  [--section.key V ...]

Setup: the demo's split (200 held-out problems, 3,000 training prompts) and a tiny Qwen3-MoE (2 layers,
hidden 128, 8 experts of width 64, top-2: demo/tiny_model.py) warm-started by supervised fine-tuning
(`--warm-steps`; about 27 ms a step on one core: 500 steps bring it to partial accuracy, 900 to
nearly all), built once and shared by everything below.

1. Mismatch: four runs of examples/demo.yaml (`launch.local`), `--steps` learner steps each, from the
   warm start, the generators recording routes in all four (`generator.record_routes true`):
   `learner.routing_replay` off and rollout, each at staleness 0 (`run.mode sync`) and 2 (async,
   `buffer.max_staleness 2`). Per run, the means over its steps of `policy/behav_prox_kl` (KL between
   the behaviour log-probs the engine sampled with and the learner's pi_old log-probs),
   `moe/route_mismatch` (share of token x layer whose top-k experts the learner's router picks
   differently from the engine's, on the pi_old forward: measured the same way with replay off and
   on, since a replaying router still computes its own choice), `moe/expert_load_max_over_mean` and
   `moe/router_entropy`; the largest `buffer/staleness_max`; the learner's mean `perf/tokens_per_s`
   (steps after the first); wall seconds of the whole run (start-up included) and from the end of
   step 0 to the last step. Step 0's KL and mismatch apart (`*_step0`): its rollouts come from the
   weights the engine loaded from disk, every later step's from weights it received in a round.
2. Learner throughput, in-process on CPU (steadier than the runs' `perf/tokens_per_s`, which share
   two cores with vLLM): the MoE, the same MoE with routing replay's router hooks replaying given
   routes (`learner.moe.Routers`), and the dense Llama of the same active size (intermediate size =
   top-k x expert width = 128), each from the same seed, on identical right-padded batches: forward
   of `learner.modeling.next_token_stats`, backward of the summed completion log-probs and a plain
   AdamW step (the learner's DeepSpeed engine is left out: its overhead is the same for both
   models). Two batches: `demo` (the demo's step: 16 prompts x 8 answers, 12 tokens each) and
   `long` (16 random sequences of 256 tokens). `--repeat` timed iterations after two untimed ones,
   models interleaved so the machine's load hits them alike; the median is reported, as real
   tokens/s, on `--threads` torch threads (1: the demo's `run.threads_per_role`).
3. `--learn` (off by default): `--learn-steps` (60) async GRPO steps of the demo with routing
   replay on, evaluated greedily on the held-out problems by the run's generator every 30 steps
   (`eval/pass@1`), as `launch.demo --demo.model qwen3_moe` runs it; held-out accuracy start -> end,
   as the engine serves it (`eval/pass@1`) and as transformers answers with the learner's last
   checkpoint (`*_transformers`).

`--quick`: a smoke run (200 warm-start steps, 4 steps a run, 3 timed iterations; with --learn, 10
steps). Progress and a table go to stderr; the last line on stdout is one JSON object.

Figures (2 cores, float32, `.venv/bin/python bench/moe.py --learn`, the other flags default; 209 s in
all, 37 s of it the warm start to 0.26 held-out accuracy, with another vLLM process running beside it;
another run, beside a system test, took 404 s, 196 s of them the warm start):

    run          kl     kl@step0  mismatch  mism@step0  stale seen  wall_s
    off_s0       0.0    0.0       0.0       0.0         0           29
    rollout_s0   0.0    0.0       0.0       0.0         0           31
    off_s2       0.030  0.0       0.020     0.0         2           33
    rollout_s2   0.030  0.0       0.021     0.0         2           32

    throughput (tokens/s)  moe     moe+replay  dense   moe/dense
    demo [128, 11]         27,590  27,494      40,964  0.67
    long [16, 256]         25,335  24,587      34,760  0.73

    learn (60 steps, 38 s): eval/pass@1 0.26 -> 0.50 (step 30) -> 0.585; the learner's last checkpoint
    (transformers) 0.26 -> 0.585

At staleness 0 the engine and the learner agree to float order at every step, weight rounds included
(|KL| under 1e-8 a step, no route differs), so routing replay on or off makes no difference there. At
staleness 2 the KL is that of the policy moving over the one or two steps the rollouts lag behind
pi_old (largest at step 2, 0.11-0.22, then 0.01-0.02 a step), and about 2% of token x layer routes
differ; replay changes neither beyond the spread between runs (the other run: KL 0.045 off, 0.033 on;
mismatch 0.023 both). Replaying the engine's routes removes only the flipped routes from pi_old's
forward, and at this size the lag of the weights dominates; `moe/route_mismatch` is measured on the
learner's own choice either way, so replay is not expected to lower it. The engine (eval/pass@1) and
transformers on the learner's checkpoint answer the held-out problems alike (0.545 both in the other run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.demo_runs import run_demo  # noqa: E402 (after the path is set)

EXPERTS, TOP_K, HIDDEN, LAYERS = 8, 2, 128, 2  # tiny_model's defaults
EXPERT_WIDTH = HIDDEN // 2  # tiny_model's default moe_intermediate_size
RUNS = {  # name -> (learner.routing_replay, the staleness flags)
    "off_s0": ("off", ["--run.mode", "sync"]),
    "rollout_s0": ("rollout", ["--run.mode", "sync"]),
    "off_s2": ("off", ["--run.mode", "async", "--buffer.max_staleness", "2"]),
    "rollout_s2": ("rollout", ["--run.mode", "async", "--buffer.max_staleness", "2"]),
}


def say(msg: str) -> None:
    print(f"[bench/moe] {msg}", file=sys.stderr, flush=True)


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def rnd(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


def newline_id() -> int:
    from demo.tiny_model import build_tokenizer

    return build_tokenizer().convert_tokens_to_ids("\n")


def setup(out: Path, warm_steps: int) -> dict:
    """The split, the base MoE, its warm start (timed) and the warm start's held-out greedy accuracy."""
    from demo.arithmetic import greedy_accuracy, make_problems, warm_start, write_jsonl
    from demo.tiny_model import build_tiny_model

    heldout = make_problems(200, seed=10_000)
    train = make_problems(3000, seed=0, exclude={q["prompt"] for q in heldout})
    base = build_tiny_model(out / "base", family="qwen3_moe", num_experts=EXPERTS, experts_per_token=TOP_K, seed=0)
    t0 = time.perf_counter()
    warm = warm_start(base, out / "warm", train, warm_steps, seed=0, log_every=0)
    warm_s = time.perf_counter() - t0
    acc = greedy_accuracy(str(warm), heldout)
    say(f"warm start: {warm_steps} steps in {warm_s:.1f}s, held-out greedy accuracy {acc:.3f}")
    return {"heldout": heldout, "train": train, "warm": warm, "warm_s": warm_s, "acc": acc,
            "prompts": write_jsonl(train, out / "train.jsonl"),
            "heldout_path": write_jsonl(heldout, out / "heldout.jsonl")}


def demo_flags(s: dict, steps: int) -> list[str]:
    return ["--learner.model_path", str(s["warm"]), "--buffer.prompts", str(s["prompts"]),
            "--learner.total_steps", str(steps), "--learner.save_every", "0",
            "--generator.stop_token_ids", str(newline_id())]


def mismatch_run(name: str, out: Path, s: dict, steps: int, overrides: list[str]) -> dict:
    """One demo run of RUNS[name]; its per-step means (see the module docstring)."""
    replay, staleness = RUNS[name]
    t0 = time.perf_counter()
    cfg, rows = run_demo(name, out / name, [*demo_flags(s, steps), "--learner.routing_replay", replay,
                                            "--generator.record_routes", "true", *staleness, *overrides])
    wall = time.perf_counter() - t0
    rows = [r for r in rows if "loss/policy" in r]

    def col(key: str, skip: int = 0) -> list[float]:
        return [r[key] for r in rows[skip:] if r.get(key) is not None]

    missing = [k for k in ("policy/behav_prox_kl", "moe/route_mismatch", "moe/expert_load_max_over_mean",
                           "moe/router_entropy", "buffer/staleness_max") if not col(k)]
    if missing:
        say(f"{name}: no {', '.join(missing)} in {out / name / 'metrics.jsonl'} "
            f"(its keys: {sorted(rows[0]) if rows else []})")
    return {
        "routing_replay": replay,
        "max_staleness": cfg.buffer.max_staleness,
        "steps": len(rows),
        "behav_prox_kl": rnd(mean(col("policy/behav_prox_kl")), 6),
        "route_mismatch": rnd(mean(col("moe/route_mismatch")), 4),
        # step 0 alone: the engine still serves the weights it loaded from disk (no weight round yet)
        "behav_prox_kl_step0": rnd(rows[0].get("policy/behav_prox_kl"), 6) if rows else None,
        "route_mismatch_step0": rnd(rows[0].get("moe/route_mismatch"), 4) if rows else None,
        "expert_load_max_over_mean": rnd(mean(col("moe/expert_load_max_over_mean")), 3),
        "router_entropy": rnd(mean(col("moe/router_entropy")), 4),
        "staleness_max": max(col("buffer/staleness_max"), default=None),
        "reward_mean": rnd(mean(col("reward/mean")), 4),
        "learner_tokens_per_s": rnd(mean(col("perf/tokens_per_s", skip=1)), 1),
        "wall_s": round(wall, 1),
        "steps_wall_s": round(rows[-1]["time"] - rows[0]["time"], 1) if len(rows) > 1 else None,
        "missing": missing,
    }


def batches(train: list[dict], seed: int = 0) -> dict:
    """name -> (input_ids (B, L), attention_mask (B, L), completion mask (B, L-1)), right-padded."""
    import torch

    from demo.tiny_model import build_tokenizer

    tok = build_tokenizer()
    rows = [(tok(p["prompt"])["input_ids"], tok(p["label"] + "\n", add_special_tokens=False)["input_ids"])
            for p in train[:16] for _ in range(8)]  # the demo's step: 16 prompts x 8 samples
    L = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), L), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(rows), L), dtype=torch.long)
    comp = torch.zeros((len(rows), L - 1))
    for i, (a, b) in enumerate(rows):
        ids[i, : len(a) + len(b)] = torch.tensor(a + b)
        att[i, : len(a) + len(b)] = 1
        comp[i, len(a) - 1: len(a) + len(b) - 1] = 1  # the positions that predict the answer
    g = torch.Generator().manual_seed(seed)
    long_ids = torch.randint(4, len(tok), (16, 256), generator=g)  # (16, 256)
    long_comp = torch.zeros((16, 255))
    long_comp[:, 32:] = 1  # a 32-token prompt, the rest completion
    return {"demo": (ids, att, comp), "long": (long_ids, torch.ones_like(long_ids), long_comp)}


def throughput(out: Path, train: list[dict], repeat: int, threads: int) -> dict:
    """Median real tokens/s of forward + backward + AdamW step per model and batch (module docstring)."""
    import torch

    from demo.tiny_model import build_tiny_model
    from learner.modeling import load_causal_lm, next_token_stats
    from learner.moe import Routers

    torch.set_num_threads(threads)
    moe_dir = build_tiny_model(out / "tp_moe", family="qwen3_moe", num_experts=EXPERTS, experts_per_token=TOP_K,
                               seed=0)
    dense_dir = build_tiny_model(out / "tp_dense", intermediate_size=TOP_K * EXPERT_WIDTH, seed=0)
    models = {"moe": load_causal_lm(str(moe_dir)).train(), "moe_replay": load_causal_lm(str(moe_dir)).train(),
              "dense": load_causal_lm(str(dense_dir)).train()}
    Routers.attach(models["moe_replay"], "rollout")
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-6) for k, m in models.items()}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    result = {"threads": threads, "repeat": repeat, "params": {"moe": params["moe"], "dense": params["dense"]},
              "batches": {}}
    for bname, (ids, att, comp) in batches(train).items():
        tokens = int(att.sum())
        g = torch.Generator().manual_seed(1)
        # routes (B, L, layers, k): k distinct experts per token and layer, -1 on the last position
        routes = torch.rand((*ids.shape, LAYERS, EXPERTS), generator=g).argsort(-1)[..., :TOP_K]
        routes[:, -1] = -1
        seconds: dict[str, list[float]] = {k: [] for k in models}
        for it in range(repeat + 2):  # the first two: warm-up, untimed
            for name, model in models.items():
                t0 = time.perf_counter()
                lp, _ = next_token_stats(model, ids, att, 1.0, routes=routes if name == "moe_replay" else None)
                (lp * comp).sum().backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                if it >= 2:
                    seconds[name].append(time.perf_counter() - t0)
        rates = {k: tokens / statistics.median(v) for k, v in seconds.items()}
        result["batches"][bname] = {
            "shape": list(ids.shape), "tokens": tokens,
            **{f"{k}_tokens_per_s": round(r, 1) for k, r in rates.items()},
            "moe_over_dense": round(rates["moe"] / rates["dense"], 3),
            "replay_over_moe": round(rates["moe_replay"] / rates["moe"], 3)}
        say(f"throughput, {bname} batch {list(ids.shape)}: "
            + ", ".join(f"{k} {r:.0f} tok/s" for k, r in rates.items()))
    return result


def learn(out: Path, s: dict, steps: int, overrides: list[str]) -> dict:
    """Async GRPO with routing replay from the warm start, evaluated greedily on the held-out problems."""
    every = max(1, steps // 2)
    t0 = time.perf_counter()
    _, rows = run_demo("learn", out / "learn", [
        *demo_flags(s, steps), "--learner.routing_replay", "rollout", "--eval.dataset", str(s["heldout_path"]),
        "--eval.every", str(every), "--eval.n_samples_per_prompt", "1", "--eval.temperature", "0",
        "--learner.save_every", str(steps), *overrides])
    wall = time.perf_counter() - t0
    from demo.arithmetic import greedy_accuracy

    last = sorted((out / "learn" / "checkpoints").glob("step_*"))
    # the learner's own last policy, answered by transformers: eval/pass@1 is what the engine serves
    learner_acc = greedy_accuracy(str(last[-1]), s["heldout"]) if last else None
    evals = {r["step"]: r["eval/pass@1"] for r in rows if "eval/pass@1" in r}
    train = [r for r in rows if "loss/policy" in r]
    tenth = max(1, len(train) // 10)
    rewards = [r["reward/mean"] for r in train]
    return {"steps": len(train), "eval_every": every, "heldout_acc": {str(k): v for k, v in sorted(evals.items())},
            "heldout_acc_start": evals.get(min(evals)) if evals else None,
            "heldout_acc_end": evals.get(max(evals)) if evals else None,
            "heldout_acc_start_transformers": s["acc"], "heldout_acc_end_transformers": learner_acc,
            "reward_first": rnd(mean(rewards[:tenth])), "reward_last": rnd(mean(rewards[-tenth:])),
            "route_mismatch": rnd(mean([r["moe/route_mismatch"] for r in train if "moe/route_mismatch" in r])),
            "staleness_max": max((r["buffer/staleness_max"] for r in train), default=None),
            "wall_s": round(wall, 1)}


def table(runs: dict, tp: dict) -> str:
    cols = ("routing_replay", "max_staleness", "steps", "behav_prox_kl", "behav_prox_kl_step0", "route_mismatch",
            "route_mismatch_step0", "expert_load_max_over_mean", "router_entropy", "staleness_max",
            "learner_tokens_per_s", "wall_s")
    heads = ("replay", "stale<=", "steps", "kl", "kl@step0", "mismatch", "mism@step0", "load max/mean", "entropy",
             "stale seen", "learner tok/s", "wall_s")
    lines = ["".join(f"{h:>14}" for h in ("run", *heads))]
    for name, r in runs.items():
        lines.append("".join(f"{str(v):>14}" for v in (name, *(r[c] for c in cols))))
    lines.append("")
    lines.append("".join(f"{h:>14}" for h in ("batch", "tokens", "moe tok/s", "moe+replay", "dense tok/s",
                                              "moe/dense")))
    for name, b in tp["batches"].items():
        lines.append("".join(f"{str(v):>14}" for v in (
            name, b["tokens"], b["moe_tokens_per_s"], b["moe_replay_tokens_per_s"], b["dense_tokens_per_s"],
            b["moe_over_dense"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="learner steps per mismatch run")
    p.add_argument("--warm-steps", type=int, default=500, help="supervised warm-start steps of the MoE")
    p.add_argument("--repeat", type=int, default=7, help="timed iterations per model and batch (the median counts)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the throughput part")
    p.add_argument("--learn", action="store_true", help="also: an async GRPO run with held-out evaluation")
    p.add_argument("--learn-steps", type=int, default=60, help="learner steps of the --learn run")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer steps everywhere")
    p.add_argument("--out", default="runs/bench_moe", help="folder for the models and runs")
    p.add_argument("overrides", nargs="*", help="run-config overrides for every run, e.g. --buffer.prompts_per_step=32")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warm_steps, a.repeat, a.learn_steps = 4, 200, 3, 10

    t_start = time.perf_counter()
    out = Path(a.out)
    s = setup(out, a.warm_steps)
    runs = {}
    for name in RUNS:
        runs[name] = mismatch_run(name, out, s, a.steps, a.overrides)
        say(f"{name}: {runs[name]}")
    tp = throughput(out, s["train"], a.repeat, a.threads)
    learned = learn(out, s, a.learn_steps, a.overrides) if a.learn else None
    if learned:
        say(f"learn: held-out accuracy {learned['heldout_acc_start']} -> {learned['heldout_acc_end']} "
            f"({learned['heldout_acc']}), {learned['wall_s']}s")
    wall = time.perf_counter() - t_start
    say(f"done in {wall:.0f}s\n{table(runs, tp)}")
    print(json.dumps({
        "bench": "moe", "quick": a.quick, "experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN,
        "warm_steps": a.warm_steps, "warm_s": round(s["warm_s"], 1), "heldout_acc_warm": s["acc"],
        "steps": a.steps, "runs": runs, "throughput": tp, "learn": learned, "wall_s": round(wall, 1)}))


if __name__ == "__main__":
    main()
