"""Every role of a run on this machine: `python -m launch.local CONFIG [--section.key VALUE ...]`.

Starts the buffer, the weight-sync service, the learner ranks, G generators and S scorers as
separate supervised processes. Each role's output goes to `<run_dir>/logs/<role>.log`; the terminal
gets a progress bar with a one-line status (step, reward, staleness, throughput). Ctrl-C or any
required role's failure stops every process (whole process groups: no orphans, no leaked ports),
and the exit code says what failed:

    0 done   2 bad config   3 buffer   4 weight sync   5 learner   6 generators   7 scorers   130 Ctrl-C

Another generator can join a running run from a second terminal:

    python -m launch.generator <run_dir>/config.yaml --generator.worker_id gen-extra

OpenRLHF's quick-start flags are accepted (`--pretrain`, `--n_samples_per_prompt`, ...); see
launch/run_config.py for the full list.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

EXIT_CODES = {"config": 2, "buffer": 3, "weight_sync": 4, "learner": 5, "generator": 6, "scorer": 7}


def role_env(threads: int) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def pinned(argv: list[str], cpus: str) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def plan_roles(run, config_path: Path) -> dict[str, list]:
    """The processes of the run, by kind, in start order."""
    from launch.supervisor import Role

    py, cfg, r = sys.executable, str(config_path), run.run
    env = role_env(r.threads_per_role)
    if r.learner_ranks > 1:
        learner_argv = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(r.learner_ranks),
                        "--master_port", str(run.weight_sync.port + 1), "-m", "launch.learner", cfg]
    else:
        learner_argv = [py, "-m", "launch.learner", cfg]
    return {
        "buffer": [Role("buffer", [py, "-m", "launch.buffer", cfg], env, ready_line="buffer ready")],
        "weight_sync": [Role("weight_sync", [py, "-m", "launch.weight_sync", cfg], env, ready_line="weight-sync service on")],
        "scorer": [Role(f"scorer-{i}", [py, "-m", "launch.scorer", cfg, "--scorer.worker_id", f"scorer-{i}"], env,
                        required=False) for i in range(r.num_scorers)],
        "generator": [Role(f"generator-{i}", pinned([py, "-m", "launch.generator", cfg, "--generator.worker_id",
                                                     f"gen-{i}", "--generator.seed", str(run.generator.seed + i)],
                                                    r.generator_cpus), env, required=False)
                      for i in range(r.num_generators)],
        "learner": [Role("learner", pinned(learner_argv, r.learner_cpus), env, ready_line="learner ready")],
    }


class Status:
    """The terminal's progress bar and one-line status, fed by the learner's metrics.jsonl."""

    def __init__(self, run):
        from tqdm import tqdm

        self.metrics_path = Path(run.run.run_dir) / "metrics.jsonl"
        self.total = run.learner.total_steps
        self.bar = tqdm(total=self.total, desc="steps", unit="step", dynamic_ncols=True, file=sys.stderr)
        self.seen = 0
        self.t0 = time.monotonic()
        self.last: dict = {}

    def tick(self) -> None:
        rows = read_metrics(self.metrics_path)
        if len(rows) > self.seen:
            self.bar.update(len(rows) - self.seen)
            self.seen = len(rows)
            m = self.last = rows[-1]

            def num(key: str, default: float = float("nan")) -> float:
                v = m.get(key)
                return default if v is None else float(v)

            busy = num("time/train_step", 0.0) + num("time/wait_for_batch", 0.0)
            self.bar.set_postfix_str(
                f"reward {num('reward/mean'):.3f} staleness {num('buffer/staleness_mean', 0.0):.2f}"
                f"/{num('buffer/staleness_max', 0.0):.0f} {num('perf/samples', 0.0) / max(busy, 1e-9):.1f} samples/s")

    def close(self) -> None:
        self.tick()
        self.bar.close()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def run_local(run, quiet: bool = False) -> int:
    """Start every role, wait for the learner to finish, stop everything; returns the exit code."""
    from launch.ports import free_port_block
    from launch.run_config import assign_ports, write_resolved
    from launch.supervisor import RoleFailed, Supervisor

    r = run.run
    run_dir = Path(r.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    assign_ports(run, r.base_port or free_port_block(6))
    config_path = write_resolved(run, run_dir / "config.yaml")
    roles = plan_roles(run, config_path)
    started = time.monotonic()
    status = None
    interrupted = []

    def on_sigterm(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_sigterm)
    sup = Supervisor(run_dir / "logs")
    try:
        with sup:
            sup.start(roles["buffer"][0], r.ready_timeout_s)
            sup.start(roles["weight_sync"][0])
            for role in roles["scorer"] + roles["generator"]:
                sup.start(role)
            learner = sup.start(roles["learner"][0], r.ready_timeout_s)
            print(f"run {run_dir}: {r.mode}, {r.num_generators} generator(s), {r.num_scorers} scorer(s), "
                  f"{r.learner_ranks} learner rank(s); logs in {run_dir / 'logs'}", file=sys.stderr, flush=True)
            status = None if quiet else Status(run)

            def tick():
                if status:
                    status.tick()
                helpers = roles["generator"]
                if all(g.returncode is not None for g in helpers):
                    raise RoleFailed("generator", helpers[0].returncode, helpers[0].log_path,
                                     "every generator has exited")
                if all(s.returncode is not None for s in roles["scorer"]):
                    raise RoleFailed("scorer", roles["scorer"][0].returncode, roles["scorer"][0].log_path,
                                     "every scorer has exited")
                if r.max_wall_s and time.monotonic() - started > r.max_wall_s:
                    raise RoleFailed("learner", None, learner.log_path, f"run exceeded run.max_wall_s={r.max_wall_s}")

            sup.wait(learner, on_tick=tick)
        code = 0
    except RoleFailed as e:
        print(f"launch.local: {e}", file=sys.stderr)
        kind = e.role.split("-")[0]
        code = EXIT_CODES.get(kind, 1)
    except KeyboardInterrupt:
        print("launch.local: interrupted, stopping every role", file=sys.stderr)
        code = 130
    finally:
        signal.signal(signal.SIGTERM, old)
        if status:
            status.close()
    (run_dir / "exit.json").write_text(json.dumps({"code": code, "wall_s": time.monotonic() - started}) + "\n")
    return code


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    from launch.config import ConfigError
    from launch.run_config import load_run_config

    config_path = argv.pop(0) if not argv[0].startswith("--") else None
    try:
        run = load_run_config(config_path, argv)
        if run.stale_state():
            raise ConfigError(run.stale_state())
    except ConfigError as e:
        print(f"launch.local: {e}", file=sys.stderr)
        sys.exit(EXIT_CODES["config"])
    sys.exit(run_local(run))


if __name__ == "__main__":
    main()
