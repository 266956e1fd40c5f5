"""The Ray launcher on a real (one-node) Ray cluster: the demo end to end, a generator killed and
started again, generators scaled from 1 to 2 mid-run, a request the cluster cannot hold, and a
learner killed mid-run that `run.auto_resume` starts again from its checkpoint.

One cluster serves the module: `ray start --head --block` in its own session and temp folder, as
the fixture's own child. Ending that process (SIGTERM, by its pid) stops exactly that cluster's
processes; `ray stop` is not used because it stops every Ray process of the machine (other people's
included). The demo's tiny model and warm start are built while the cluster boots.

The end-to-end run does the kill and the scaling itself (one run, to stay within the time budget):
once the learner has published version >= 1, the test kills generator-0's process group (as an
OOM kill would) and asks for 2 generators with `python -m launch.ray scale`. The learner waits for
data meanwhile; generator-0 is started again by the driver, generator-1 catches up with the current
weights before its first lease, and both generate until the run ends.

The resume test SIGKILLs the learner between two checkpoints: the driver frees the job's actors
and placement groups, starts the whole job again on the same cluster with `learner.resume true`,
and the run ends with every step trained exactly once (the learner's ledger).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_port_block, subprocess_env

PY = sys.executable
RAY = str(Path(sys.executable).with_name("ray"))
# With one generator the learner does ~3 steps/s here; after the kill it waits for whichever of the
# restarted and the added generator is ready first, and the other one is up to ~20 s later (two vLLM
# engines starting at once on 2 cores): 150 steps leave it time to generate too.
STEPS = 150
# the resume test: killed after step 7, resumed from the checkpoint at step 5 (a few steps of margin
# before the end, so the kill lands mid-run)
RESUME_STEPS = 15
# the run's processes share 4 logical CPUs (they are scheduling tokens; the machine has 2 cores)
SMALL = ["--ray.buffer.num_cpus", "0.25", "--ray.weight_sync.num_cpus", "0.25", "--ray.scorer.num_cpus", "0.5",
         "--ray.learner.num_cpus", "1", "--ray.generator.num_cpus", "0.75"]


# ---- no cluster needed ----------------------------------------------------------------------


def test_ray_section_is_read_apart_from_the_run_config(tmp_path):
    from launch.config import ConfigError
    from launch.ray_config import split_ray_section

    cfg = tmp_path / "run.yaml"
    cfg.write_text("ray:\n  generator: {num_gpus: 1, strategy: SPREAD}\n  max_restarts: 5\nlearner:\n  lr: 0.1\n")
    rcfg, tree, rest = split_ray_section(cfg, ["--ray.learner.num_gpus", "2", "--learner.total_steps", "3",
                                               "--ray.address=auto"])
    assert (rcfg.generator.num_gpus, rcfg.generator.strategy, rcfg.max_restarts) == (1.0, "SPREAD", 5)
    assert rcfg.learner.num_gpus == 2.0 and rcfg.address == "auto"
    assert rcfg.buffer.num_cpus == 0.5  # the services' own default
    assert tree == {"learner": {"lr": 0.1}} and rest == ["--learner.total_steps", "3"]
    with pytest.raises(ConfigError, match="ray.generator.strategy='SIDEWAYS'"):
        split_ray_section(cfg, ["--ray.generator.strategy", "SIDEWAYS"])
    with pytest.raises(ConfigError, match="unknown key 'num_gpu'"):
        split_ray_section(cfg, ["--ray.scorer.num_gpu", "1"])


def test_paths_become_absolute_and_addresses_reach_every_role(tmp_path, monkeypatch):
    from launch.ray_config import load, tie_addresses

    monkeypatch.chdir(ROOT)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    rcfg, run = load("examples/demo.yaml", ["--learner.model_path", ".", "--buffer.prompts", str(prompts),
                                            "--run.run_dir", "runs/x", "--ray.max_restarts", "1"])
    assert rcfg.max_restarts == 1
    # the roles run from another folder (maybe on another node): every path they read is absolute
    assert run.run.run_dir == run.learner.run_dir == str(ROOT / "runs" / "x")
    assert run.buffer.state_dir == str(ROOT / "runs" / "x" / "buffer_state")
    assert run.scorer.reward_fn == str(ROOT / "examples" / "rewards" / "arithmetic.py")
    assert run.learner.model_path == run.generator.model == str(ROOT)
    run.buffer.host, run.buffer.port, run.weight_sync.host, run.weight_sync.port = "10.0.0.5", 40000, "10.0.0.6", 41000
    tie_addresses(run)
    for sec in (run.generator, run.scorer, run.learner):
        assert (sec.buffer_host, sec.buffer_port) == ("10.0.0.5", 40000)
    for sec in (run.generator, run.learner):
        assert (sec.weight_sync_host, sec.weight_sync_port) == ("10.0.0.6", 41000)


def test_resource_check_names_the_role_and_the_resource():
    from launch.ray_config import ResourceError, check_resources

    two_nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    fits = [("learner", [{"CPU": 1.0, "GPU": 1.0}] * 4, "PACK"), ("generator", [{"CPU": 1.0}] * 2, "SPREAD")]
    check_resources(fits, two_nodes)  # 4 GPUs over 2 nodes: fine
    # a bundle bigger than any node: named role, named resource
    with pytest.raises(ResourceError, match=r"role 'generator' asks for GPU 4 per process.*largest node: GPU 2"):
        check_resources([("generator", [{"CPU": 1.0, "GPU": 4.0}], "PACK")], two_nodes)
    # each bundle fits, the sum does not: the roles asking are listed
    with pytest.raises(ResourceError, match=r"GPU 5 in all \(learner 4 x GPU 1; generator 1 x GPU 1\).*cluster has GPU 4"):
        check_resources([("learner", [{"CPU": 1.0, "GPU": 1.0}] * 4, "PACK"),
                         ("generator", [{"CPU": 1.0, "GPU": 1.0}], "PACK")], two_nodes)
    # STRICT_PACK wants one node for all of a role's bundles; STRICT_SPREAD one node each
    with pytest.raises(ResourceError, match="role 'learner': 3 processes with strategy STRICT_PACK"):
        check_resources([("learner", [{"CPU": 1.0, "GPU": 1.0}] * 3, "STRICT_PACK")], two_nodes)
    with pytest.raises(ResourceError, match="STRICT_SPREAD need as many nodes, but only 2"):
        check_resources([("generator", [{"CPU": 1.0}] * 3, "STRICT_SPREAD")], two_nodes)


def test_failures_give_exit_codes_and_only_core_roles_are_resumed(tmp_path):
    """What run_ray does with each way an attempt ends, without a cluster: `attempt_code` gives the
    exit code, `with_auto_resume` starts a new attempt after a learner/buffer/weight-sync failure."""
    from types import SimpleNamespace

    from launch.ray import FinalExit, RunFailed, attempt_code
    from launch.ray_config import ResourceError
    from launch.recovery import Stalled, with_auto_resume

    said: list[str] = []

    def ends(outcomes):
        """An attempt as run_ray makes one; each call takes the next outcome (an exit code or an error)."""
        outcomes = iter(outcomes)

        def go():
            o = next(outcomes)
            if isinstance(o, BaseException):
                raise o
            return o

        return lambda: attempt_code(go, said.append)

    codes = {"buffer": 3, "weight_sync": 4, "learner": 5, "generator": 6, "scorer": 7}
    for kind, code in codes.items():
        assert ends([RunFailed(kind, f"{kind} died")])() == code
    assert said[-1] == "scorer died"
    assert ends([ResourceError("no GPU")])() == 2
    assert ends([Stalled("no learner step for 1200s")])() == 8 and said[-1].startswith("stalled: no learner step")
    assert ends([KeyboardInterrupt()])() == 130 and said[-1] == "interrupted, stopping every role"
    with pytest.raises(FinalExit) as e:  # run.max_wall_s spent: resuming would not help
        ends([RunFailed("learner", "run exceeded run.max_wall_s=60", resumable=False)])()
    assert e.value.code == 5

    def run_with(auto_resume: int):
        return SimpleNamespace(run=SimpleNamespace(auto_resume=auto_resume, run_dir=str(tmp_path)),
                               learner=SimpleNamespace(resume=False))

    # a learner, buffer or weight-sync failure: the run starts again with learner.resume, while resumes last
    run = run_with(2)
    assert with_auto_resume(run, ends([RunFailed("learner", "-9"), RunFailed("buffer", "-9"), 0]), said.append) == (0, 2)
    assert run.learner.resume is True and said[-1].startswith("auto-resume 2/2: exit code 3")
    run = run_with(1)
    assert with_auto_resume(run, ends([RunFailed("weight_sync", "x"), RunFailed("learner", "y")]), said.append) == (5, 1)
    # a generator/scorer failure, a stall, Ctrl-C: never resumed
    for outcome, code in ((RunFailed("generator", "every generator has exited"), 6), (Stalled("s"), 8),
                          (KeyboardInterrupt("SIGTERM received"), 130)):
        run = run_with(3)
        assert with_auto_resume(run, ends([outcome]), said.append) == (code, 0)  # a second call would fail: one outcome
        assert run.learner.resume is False


# ---- on a cluster ----------------------------------------------------------------------------


def ray_env() -> dict[str, str]:
    """The test's cluster and its clients: no token authentication (one node, the test's own), so
    the outcome does not depend on whether ~/.ray/auth_token happens to exist on this machine."""
    return {**subprocess_env(), "RAY_AUTH_MODE": "disabled"}


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster with 4 logical CPUs, starting in the background (`cluster_address`
    waits for it and gives its GCS address)."""
    # a short temp folder: Ray's unix socket paths must stay under 107 characters
    temp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")
    port = free_port_block(1)
    log_path = Path(temp) / "head.log"
    log = open(log_path, "wb")
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--num-cpus", "4", "--num-gpus", "0", "--port", str(port),
                             "--temp-dir", temp, "--include-dashboard", "false", "--disable-usage-stats"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=ray_env(),
                            start_new_session=True)
    log.close()
    try:
        yield {"head": head, "log": log_path, "port": port}
    finally:
        head.terminate()  # `ray start --block` shuts its own processes down on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        shutil.rmtree(temp, ignore_errors=True)


def cluster_address(cluster) -> str:
    def ready():
        text = cluster["log"].read_text(errors="replace")
        if cluster["head"].poll() is not None:
            raise AssertionError(f"ray start exited with code {cluster['head'].returncode}:\n{text[-3000:]}")
        return "block forever" in text and text

    text = wait_for(ready, 120, "the Ray head to start")
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # with ray[default] installed, `ray start` prints in colour
    ip = re.search(r"Local node IP: (\S+)", text).group(1)
    return f"{ip}:{cluster['port']}"


@pytest.fixture(scope="module")
def demo(cluster, tmp_path_factory):
    """The demo's inputs as launch.demo builds them: prompts, held-out set, tiny model, warm start."""
    from demo.arithmetic import make_problems, warm_start, write_jsonl
    from demo.tiny_model import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("ray_demo")
    heldout = make_problems(50, seed=10_000)
    train = make_problems(3000, seed=0, exclude={p["prompt"] for p in heldout})
    prompts = write_jsonl(train, out / "train.jsonl")
    base = build_tiny_model(out / "base", seed=0)
    warm = warm_start(base, out / "warm", train, 375, seed=0, log_every=0)
    newline = build_tokenizer().convert_tokens_to_ids("\n")
    return {"address": cluster_address(cluster), "model": str(warm), "prompts": str(prompts),
            "newline": newline}


def launch_argv(demo: dict, run_dir: Path, *extra: str) -> list[str]:
    return [PY, "-m", "launch.ray", str(ROOT / "examples" / "demo.yaml"), "--ray.address", demo["address"],
            "--learner.model_path", demo["model"], "--buffer.prompts", demo["prompts"],
            "--generator.stop_token_ids", str(demo["newline"]), "--run.run_dir", str(run_dir), *SMALL, *extra]


def control(demo: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "launch.ray", *args, "--address", demo["address"]], capture_output=True,
                          text=True, env=ray_env(), cwd=ROOT, timeout=120)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


@pytest.mark.slow
def test_more_than_the_cluster_has_fails_fast_naming_role_and_resource(demo, tmp_path):
    t0 = time.monotonic()
    res = subprocess.run(launch_argv(demo, tmp_path / "run", "--ray.generator.num_gpus", "1"), capture_output=True,
                         text=True, env=ray_env(), cwd=ROOT, timeout=120)
    wall = time.monotonic() - t0
    assert res.returncode == 2, res.stderr[-3000:]
    assert "role 'generator' asks for GPU 1 per process" in res.stderr, res.stderr[-3000:]
    assert "no node of the cluster has GPU 1" in res.stderr
    assert wall < 60, f"took {wall:.0f}s to refuse"
    # nothing of it is left on the cluster: no roles started, so no role logs (the launcher's own says why)
    logs = tmp_path / "run" / "logs"
    assert sorted(p.name for p in logs.glob("*")) in ([], ["launcher.log"])
    assert json.loads((tmp_path / "run" / "exit.json").read_text())["code"] == 2


@pytest.mark.slow
def test_demo_end_to_end_with_a_generator_killed_and_scaled_to_two(demo, tmp_path):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch_ray.log"
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(launch_argv(demo, run_dir, "--learner.total_steps", str(STEPS),
                                              "--buffer.lease_ttl_s", "15", "--learner.save_every", "0"),
                                  stdout=log, stderr=subprocess.STDOUT, env=ray_env(), cwd=ROOT,
                                  start_new_session=True)
    try:
        def launched():
            if driver.poll() is not None:
                raise AssertionError(f"launch.ray exited early ({driver.returncode}):\n"
                                     + log_path.read_text(errors="replace")[-4000:])
            return "controller 'conveyor-run:run'" in log_path.read_text(errors="replace")

        wait_for(launched, 300, "every role to start")
        # where generator-0 runs, from the run's controller (what `launch.ray status` prints)
        st = control(demo, "status", "--run", "run")
        assert st.returncode == 0, st.stderr[-3000:]
        roles = {r["name"]: r for r in json.loads(st.stdout)["run"]["roles"]}
        assert set(roles) == {"buffer", "weight_sync", "scorer-0", "generator-0", "learner-0"}
        assert all(r["state"] == "running" for r in roles.values()), roles

        # once the learner has published version >= 1: kill generator-0 and its vLLM engine (as an
        # OOM kill would) and ask for a second generator; the learner waits for data meanwhile
        wait_for(lambda: driver.poll() is None and len(metrics(run_dir)) >= 1, 300, "the learner's first step")
        os.killpg(roles["generator-0"]["pid"], signal.SIGKILL)
        sc = control(demo, "scale", "--run", "run", "--generators", "2")
        assert sc.returncode == 0, sc.stderr[-3000:]
        assert "generators 1 -> 2" in sc.stdout

        driver.wait(timeout=600)
    finally:
        if driver.poll() is None:
            driver.terminate()  # the launcher stops every role it started
            driver.wait(timeout=120)
    out = log_path.read_text(errors="replace")
    assert driver.returncode == 0, out[-4000:]

    # the run completed and learned, as with the local launcher
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS)), out[-2000:]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.03, f"reward/mean {first:.3f} (first 10 steps) -> {last:.3f} (last 10)"

    # generator-0 was started again after the kill, and generated again
    assert re.search(r"generator-0 exited with code -9 .*restart 1/3", out), out[-4000:]
    gen0_log = (run_dir / "logs" / "generator-0.log").read_text(errors="replace")
    assert gen0_log.count("=== launch.ray: start") == 2
    after_restart = gen0_log.split("=== launch.ray: start 2 of generator-0")[1]
    assert re.search(r"lease \d+: ", after_restart), after_restart[-3000:]

    # generator-1 got the current weights before its first lease, then generated
    gen1_log = (run_dir / "logs" / "generator-1.log").read_text(errors="replace")
    loaded = re.search(r"weights v(\d+) loaded", gen1_log)
    first_lease = re.search(r"lease \d+: \d+ groups x \d+ samples \(v(\d+)\)", gen1_log)
    assert loaded and first_lease, gen1_log[-3000:]
    assert loaded.start() < first_lease.start()
    assert int(loaded.group(1)) >= 1 and int(first_lease.group(1)) >= int(loaded.group(1))

    # both generators contributed rollouts (pushed right after each lease's batch): their final counts
    for log in (after_restart, gen1_log):
        final = re.findall(r"total: \d+ tokens .*, (\d+) samples, (\d+) groups; total leases=(\d+)", log)
        assert final and int(final[-1][0]) > 0 and int(final[-1][2]) >= 1, log[-2000:]

    # the resolved per-role configs carry the discovered addresses
    cfg = (run_dir / "configs" / "generator-1.yaml").read_text()
    buffer_addr = re.search(r"buffer on (\S+):(\d+)", out)
    assert f"buffer_host: {buffer_addr.group(1)}" in cfg and f"buffer_port: {buffer_addr.group(2)}" in cfg

    # nothing of the run is left running: every pid the launcher started has exited
    for name in ("buffer", "weight_sync", "scorer-0", "learner-0"):
        pid = roles[name]["pid"]
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_learner_killed_mid_run_is_resumed_from_its_checkpoint(demo, tmp_path):
    """SIGKILL the learner after step 7 (a checkpoint at step 5): with run.auto_resume 1 the driver
    frees the job's actors and placement groups, starts the whole job again with learner.resume and
    new ports, and the run ends at total_steps with every step trained exactly once."""
    total, save_every = RESUME_STEPS, 5
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch_ray.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(launch_argv(demo, run_dir, "--run.auto_resume", "1", "--learner.total_steps",
                                              str(total), "--learner.save_every", str(save_every),
                                              "--ray.run_name", "resume"),
                                  stdout=log, stderr=subprocess.STDOUT, env=ray_env(), cwd=ROOT,
                                  start_new_session=True)
    try:
        def launched():
            if driver.poll() is not None:
                raise AssertionError(f"launch.ray exited early ({driver.returncode}):\n"
                                     + log_path.read_text(errors="replace")[-4000:])
            return "controller 'conveyor-run:resume'" in log_path.read_text(errors="replace")

        wait_for(launched, 300, "every role to start")
        st = control(demo, "status", "--run", "resume")
        assert st.returncode == 0, st.stderr[-3000:]
        learner = next(r for r in json.loads(st.stdout)["run"]["roles"] if r["name"] == "learner-0")
        wait_for(lambda: driver.poll() is None and len(metrics(run_dir)) >= 7, 300, "the learner's 7th step",
                 poll_s=0.1)
        killed_at = len(metrics(run_dir))
        os.kill(learner["pid"], signal.SIGKILL)  # the learner alone, as an OOM kill would
        driver.wait(timeout=900)
    finally:
        if driver.poll() is None:
            driver.terminate()
            driver.wait(timeout=120)
    wall = time.monotonic() - t0
    out = log_path.read_text(errors="replace")
    assert driver.returncode == 0, out[-4000:]
    assert killed_at < total, f"the run had done {killed_at} of {total} steps when the learner was killed"

    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert exit_info["code"] == 0 and exit_info["resumes"] == 1, exit_info
    assert exit_info["restarts"] == 0, exit_info

    # the driver said why it started again, on the terminal and in logs/launcher.log
    launcher_log = (run_dir / "logs" / "launcher.log").read_text()
    assert re.search(r"role 'learner-0' exited with code -9", launcher_log), launcher_log[-3000:]
    assert "auto-resume 1/1: exit code 5" in launcher_log and "auto-resume 1/1: exit code 5" in out

    # the second attempt: learner.resume in its resolved configs, with the buffer it discovered anew
    cfg = yaml.safe_load((run_dir / "configs" / "learner-0.yaml").read_text())
    assert cfg["learner"]["resume"] is True
    buffers = re.findall(r"buffer on (\S+):(\d+)", out)
    assert len(buffers) == 2, out[-4000:]
    assert (cfg["learner"]["buffer_host"], str(cfg["learner"]["buffer_port"])) == buffers[-1]
    learner_log = (run_dir / "logs" / "learner-0.log").read_text(errors="replace")
    resumed = re.search(r"resumed from \S+step_(\d+) at step (\d+)", learner_log)
    assert resumed and int(resumed.group(2)) >= save_every, learner_log[-3000:]

    # the run ended at total_steps, each step trained once, no prompt group in two steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{total}"
    state = json.loads((run_dir / "checkpoints" / f"step_{total}" / "trainer_state.json").read_text())
    assert state["step"] == total
    rows = ledger(run_dir)
    assert sorted(r["step"] for r in rows) == list(range(total)), [r["step"] for r in rows]
    seen: dict[int, int] = {}
    for r in rows:
        for g in r["groups"]:
            assert g not in seen, f"group {g} trained at steps {seen[g]} and {r['step']}"
            seen[g] = r["step"]
    print(f"resume test: killed after {killed_at} steps, resumed at step {resumed.group(2)}; wall {wall:.0f}s")


@pytest.mark.slow
def test_no_learner_step_for_stall_timeout_stops_the_run_with_the_buffers_diagnosis(demo, tmp_path):
    """A generator frozen mid-run (SIGSTOP: alive, so nothing restarts it) leaves the learner with no
    batch: after run.stall_timeout_s the run stops with code 8 and the buffer's account of why, and
    is not resumed."""
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch_ray.log"
    with open(log_path, "wb") as log:
        driver = subprocess.Popen(launch_argv(demo, run_dir, "--run.stall_timeout_s", "15", "--run.auto_resume", "1",
                                              "--learner.total_steps", "200", "--ray.run_name", "stall"),
                                  stdout=log, stderr=subprocess.STDOUT, env=ray_env(), cwd=ROOT,
                                  start_new_session=True)
    try:
        wait_for(lambda: driver.poll() is None and len(metrics(run_dir)) >= 3, 300, "the learner's 3rd step",
                 poll_s=0.2)
        st = control(demo, "status", "--run", "stall")
        assert st.returncode == 0, st.stderr[-3000:]
        gens = [r for r in json.loads(st.stdout)["run"]["roles"] if r["name"].startswith("generator")]
        assert gens
        for g in gens:
            os.kill(g["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        driver.wait(timeout=300)
        took = time.monotonic() - t0
    finally:
        if driver.poll() is None:
            driver.terminate()
            driver.wait(timeout=120)
    assert driver.returncode == 8, log_path.read_text(errors="replace")[-4000:]
    assert took < 15 + 90, took  # the bound, plus stopping every role
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert (exit_info["code"], exit_info["resumes"]) == (8, 0), exit_info
    said = (run_dir / "logs" / "launcher.log").read_text()
    assert "stall_timeout_s=15" in said and "auto-resume" not in said, said[-3000:]
