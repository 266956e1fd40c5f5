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

from launch.ports import free_port_block
from tests.helpers.cluster import metrics, run_quick_start, run_status, stop_driver, wait_for
from tests.helpers.procs import ROOT, subprocess_env

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
    from common.config import ConfigError
    from launch.cluster.config import split_ray_section

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
    from launch.cluster.config import load, tie_addresses

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
    from launch.cluster.config import ResourceError, check_resources

    two_nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    fits = [("learner", [{"CPU": 1.0, "GPU": 1.0}] * 4, "PACK"), ("generator", [{"CPU": 1.0}] * 2, "SPREAD")]
    check_resources(fits, two_nodes)  # 4 GPUs over 2 nodes: fine
    # a bundle bigger than any node: named role, named resource
    with pytest.raises(ResourceError, match=r"role 'generator' asks for GPU 4 per process.*largest node: GPU 2"):
        check_resources([("generator", [{"CPU": 1.0, "GPU": 4.0}], "PACK")], two_nodes)
    # each bundle fits, the sum does not: the roles asking are listed
    with pytest.raises(ResourceError,
                       match=r"GPU 5 in all \(learner 4 x GPU 1; generator 1 x GPU 1\).*cluster has GPU 4"):
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

    from launch.cluster.config import ResourceError
    from launch.ray import FinalExit, RunFailed, attempt_code
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
    assert with_auto_resume(run, ends([RunFailed("learner", "-9"), RunFailed("buffer", "-9"), 0]),
                            said.append) == (0, 2)
    assert run.learner.resume is True and said[-1].startswith("auto-resume 2/2: exit code 3")
    run = run_with(1)
    assert with_auto_resume(run, ends([RunFailed("weight_sync", "x"), RunFailed("learner", "y")]),
                            said.append) == (5, 1)
    # a generator/scorer failure, a stall, Ctrl-C: never resumed
    for outcome, code in ((RunFailed("generator", "every generator has exited"), 6), (Stalled("s"), 8),
                          (KeyboardInterrupt("SIGTERM received"), 130)):
        run = run_with(3)
        assert with_auto_resume(run, ends([outcome]), said.append) == (code, 0)  # a second call would fail: one outcome
        assert run.learner.resume is False


def test_both_launchers_start_the_processes_of_one_plan(monkeypatch):
    """launch.local and launch.ray build their roles from launch.roles.plan: the same processes in the
    same order and argv; the learner is one torchrun process locally and a process per rank on Ray."""
    from launch.cluster.config import load
    from launch.roles import CONFIG, RestartPolicy, State, after_exit, plan

    monkeypatch.chdir(ROOT)
    rcfg, run = load("examples/demo.yaml", ["--learner.model_path", ".", "--buffer.prompts", "examples/demo.yaml",
                                            "--run.num_generators", "2", "--run.learner_ranks", "2",
                                            "--run.generator_cpus", "0"])
    run.weight_sync.port = 41000
    policy = RestartPolicy(3, 0.5)
    local, ray = plan(run, "local", policy), plan(run, "ray", policy)
    names = ["buffer", "weight_sync", "scorer-0", "generator-0", "generator-1"]
    assert [s.name for s in local] == names + ["learner"]
    assert [s.name for s in ray] == names + ["learner-0", "learner-1"]
    for a, b in zip(local[:5], ray[:5]):
        assert (a.kind, a.argv, a.required, a.restart, a.ready) == (b.kind, b.argv, b.required, b.restart, b.ready)
    assert local[4].command("c.yaml")[:3] == ["taskset", "-c", "0"] and ray[4].command("c.yaml")[0] == "{python}"
    assert ray[4].command("c.yaml")[-4:] == ["--generator.worker_id", "gen-1", "--generator.seed",
                                             str(run.generator.seed + 1)]
    assert local[-1].argv[:3] == ["{python}", "-m", "torch.distributed.run"] and "41001" in local[-1].argv
    assert ray[-1].argv == ["{python}", "-m", "launch.learner", CONFIG]
    # waited for before the next role: the services and the learner's rank 0, by their ready files
    assert [s.name for s in ray if s.ready.wait] == ["buffer", "weight_sync", "learner-0"]
    assert ray[-1].ready.probe == "none" and all(s.ready.probe == "file" for s in ray[:-1])
    # what an exit means: generators and scorers heal while restarts last; the rest stop the run
    buffer, gen, learner = ray[0], ray[3], ray[-2]
    assert after_exit(learner, 0, 0) == State.DONE and after_exit(learner, 0, -9) == State.FAILED
    assert after_exit(buffer, 0, 0) == State.FAILED  # a service never finishes
    assert after_exit(gen, 2, -9) == State.RESTARTING and after_exit(gen, 3, -9) == State.FAILED
    assert after_exit(gen, 0, 0) == State.DONE and after_exit(gen, 0, 0, lost=True) == State.RESTARTING


# ---- on a cluster ----------------------------------------------------------------------------


def ray_env() -> dict[str, str]:
    """The test's cluster and its clients: no token authentication (one node, the test's own), so
    the outcome does not depend on whether ~/.ray/auth_token happens to exist on this machine."""
    return {**subprocess_env(), "RAY_AUTH_MODE": "disabled"}






@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster with 4 logical CPUs, starting in the background (`cluster_address`
    waits for it and gives its GCS address)."""
    # a short temp folder: Ray's unix socket paths must stay under 107 characters
    temp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")
    port = free_port_block(1)
    log_path = Path(temp) / "head.log"
    log = open(log_path, "wb")
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--num-cpus", "4", "--num-gpus", "0",
                             "--port", str(port), "--temp-dir", temp, "--include-dashboard", "false",
                             "--disable-usage-stats"],
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




def launched(driver: subprocess.Popen, run_dir: Path, log_path: Path):
    """A wait_for predicate: every role started (the driver's status says so)."""
    def pred():
        if driver.poll() is not None:
            raise AssertionError(f"launch.ray exited early ({driver.returncode}):\n"
                                 + log_path.read_text(errors="replace")[-4000:])
        return run_status(run_dir).get("launched")

    return pred




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
        wait_for(launched(driver, run_dir, log_path), 300, "every role to start")
        assert run_status(run_dir)["run_name"] == "run"
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
        stop_driver(driver)
    out = log_path.read_text(errors="replace")
    assert driver.returncode == 0, out[-4000:]

    # the run completed and learned, as with the local launcher
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS)), out[-2000:]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.03, f"reward/mean {first:.3f} (first 10 steps) -> {last:.3f} (last 10)"

    # generator-0 was started again after the kill (once), and its new process served again if it
    # became ready before the run ended
    final = run_status(run_dir)
    after = {r["name"]: r for r in final["roles"]}
    gen0, gen1 = after["generator-0"], after["generator-1"]
    assert (gen0["restarts"], gen0["starts"], gen0["code"]) == (1, 2, -9), gen0
    assert gen0["pid"] != roles["generator-0"]["pid"], gen0
    # (its new engine starts while generator-1's does; on a loaded machine one may take over 80 s,
    # and the run may end first: then only generator-1 served, and generator-0 wrote no record)
    assert gen0["ready"] is None or gen0["ready"]["pid"] == gen0["pid"], gen0
    assert json.loads((run_dir / "exit.json").read_text())["restarts"] == 1

    # generator-1 had the current weights when it became ready, i.e. before its first lease
    assert gen1["ready"]["worker_id"] == "gen-1" and gen1["ready"]["version"] >= 1, gen1

    # both generators contributed rollouts: the last record each wrote as it exited (the killed
    # generator-0 had no time to; its new process did) counts the samples it pushed and its leases.
    # Its new process may also have become ready just as the run ended, and been stopped before it
    # wrote that record (one run in about ten on a loaded machine): then only generator-1's counts
    restarted_in_time = gen0["ready"] is not None and "final" in gen0["ready"]
    for gen in (gen0, gen1) if restarted_in_time else (gen1,):
        assert gen["ready"]["final"] and gen["ready"]["samples"] > 0 and gen["ready"]["leases"] >= 1, gen

    # the resolved per-role configs carry the discovered addresses
    cfg = yaml.safe_load((run_dir / "configs" / "generator-1.yaml").read_text())
    host, port = final["buffer"].rsplit(":", 1)
    assert (cfg["generator"]["buffer_host"], str(cfg["generator"]["buffer_port"])) == (host, port)
    assert after["buffer"]["ready"]["control"] == f"tcp://{host}:{port}"

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
        wait_for(launched(driver, run_dir, log_path), 300, "every role to start")
        st = control(demo, "status", "--run", "resume")
        assert st.returncode == 0, st.stderr[-3000:]
        learner = next(r for r in json.loads(st.stdout)["run"]["roles"] if r["name"] == "learner-0")
        wait_for(lambda: driver.poll() is None and len(metrics(run_dir)) >= 7, 300, "the learner's 7th step",
                 poll_s=0.1)
        killed_at = len(metrics(run_dir))
        os.kill(learner["pid"], signal.SIGKILL)  # the learner alone, as an OOM kill would
        driver.wait(timeout=900)
    finally:
        stop_driver(driver)
    wall = time.monotonic() - t0
    out = log_path.read_text(errors="replace")
    assert driver.returncode == 0, out[-4000:]
    assert killed_at < total, f"the run had done {killed_at} of {total} steps when the learner was killed"

    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert exit_info["code"] == 0 and exit_info["resumes"] == 1, exit_info
    assert exit_info["restarts"] == 0, exit_info
    assert exit_info["attempts"] == [5, 0], exit_info  # the learner's failure, then the resumed run

    # the second attempt: learner.resume in its resolved configs, with the buffer it discovered anew
    cfg = yaml.safe_load((run_dir / "configs" / "learner-0.yaml").read_text())
    assert cfg["learner"]["resume"] is True
    final = run_status(run_dir)
    assert (final["attempt"], final["resumed"]) == (2, True), final
    assert f"{cfg['learner']['buffer_host']}:{cfg['learner']['buffer_port']}" == final["buffer"]
    lead = next(r for r in final["roles"] if r["name"] == "learner-0")
    assert lead["ready"]["step"] >= save_every, lead  # it was ready at its checkpoint's step, not 0

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
    print(f"resume test: killed after {killed_at} steps, resumed at step {lead['ready']['step']}; wall {wall:.0f}s")


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
        stop_driver(driver)
    assert driver.returncode == 8, log_path.read_text(errors="replace")[-4000:]
    assert took < 15 + 90, took  # the bound, plus stopping every role
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert (exit_info["code"], exit_info["resumes"], exit_info["attempts"]) == (8, 0, [8]), exit_info
    assert "stall_timeout_s=15" in exit_info["reason"] and "buffer" in exit_info["reason"], exit_info


@pytest.mark.slow
def test_the_quick_start_runs_through_the_drop_in_train_ppo_ray(cluster, quick_start_files, tmp_path):
    """`python -m launch.train_ppo_ray` with the toolkit page's PPO quick start (its models and data
    pointed at the tiny ones, sizes shrunk), as `ray job submit -- python3 -m ...` would start it:
    OpenRLHF's defaults (synchronous PPO with GAE, the critic from the reward model, one sample per
    prompt), its GPU placement flags on a cluster without GPUs, to completion."""

    run_dir = tmp_path / "checkpoint"
    argv = [PY, "-m", "launch.train_ppo_ray", *run_quick_start(quick_start_files, run_dir, "--train_batch_size", "8"),
            "--ray.address", cluster_address(cluster), *SMALL]  # (one sample per prompt: 8 a step)
    res = subprocess.run(argv, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]  # 16 prompts, 8 a step, one episode
    assert all(r["perf/samples"] == 8 and "loss/value" in r for r in rows), rows[0]  # n=1; a critic trains
    cfg = yaml.safe_load((run_dir / "configs" / "learner-0.yaml").read_text())
    assert cfg["learner"]["advantage_estimator"] == "gae" and cfg["learner"]["critic_path"] == quick_start_files["rm"]
    assert (run_dir / "checkpoints" / "step_2" / "config.json").is_file()
