"""launch.ray gives every role process the GPUs of the run's device plan (launch/cluster/devices.py).

Without Ray: the plan's nodes from `ray.nodes()`, what each process reserves per layout, the
refusals (a vLLM generator with no GPU on a GPU cluster, a Ray reservation under a colocated
layout), and `--plan` on both Ray entry points (no cluster joined, nothing written).

With Ray: one local Ray for the module with 8 logical GPUs (Ray assigns their ids and sets
CUDA_VISIBLE_DEVICES for what reserves them, as on a GPU node), and the real launcher's placement,
actors and process start, each role's command replaced by a process that writes its
CUDA_VISIBLE_DEVICES (and its memory cap, its flags) into its ready record and waits. Checked:
the separate layout's reservations are disjoint and each process sees exactly its own; a
colocated layout's processes see the ids Ray gave their planned devices' bundles (some GPUs held
by someone else first, so the ids are not the plan's indices); generators added by `scale` get
GPUs of their own (separate), or a stopped generator's seat, or a refusal (colocated).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

BASE = ["--learner.model_path", "/nonexistent/policy", "--buffer.prompts", "/nonexistent/p.jsonl",
        "--scorer.reward_fn", "r.py", "--run.curve", "off"]
# logical CPUs are scheduling tokens here: every process takes a sliver of the module's 2
SMALL = [a for k in ("buffer", "weight_sync", "scorer", "generator", "learner")
         for a in (f"--ray.{k}.num_cpus", "0.05")]
QUICK_START = ["--actor.num_gpus_per_node", "8", "--ref.num_gpus_per_node", "8", "--vllm.num_engines", "4",
               "--vllm.tensor_parallel_size", "2", "--train.colocate_all", "--vllm.gpu_memory_utilization", "0.6",
               "--pretrain", "/nonexistent/llama3-8b", "--reward_pretrain", "/nonexistent/rm",
               "--prompt_data", "/nonexistent/prompts.jsonl"]


def load(*flags: str):
    from launch.cluster.config import load as load_ray

    return load_ray(None, [*BASE, *flags], paths=False)


def devices(nodes, *flags: str, gpu_cluster=None):
    from launch.cluster.devices import RayDevices

    rcfg, run = load(*flags)
    return RayDevices.make(run, rcfg, nodes, gpu_cluster=gpu_cluster)


def ray_node(gpus: float, alive: bool = True, ip: str = "10.0.0.1") -> dict:
    res = {"CPU": 32.0, "memory": 1e11, **({"GPU": gpus, "accelerator_type:H100": 1.0} if gpus else {})}
    return {"NodeID": ip.replace(".", "") + "ff" * 10, "Alive": alive, "NodeManagerAddress": ip, "Resources": res}


# ---- no cluster -----------------------------------------------------------------------------


def test_plan_nodes_come_from_the_clusters_alive_gpu_nodes():
    from launch.cluster.devices import DEFAULT_GPU_GB, cluster_nodes

    listed = [ray_node(0, ip="10.0.0.9"), ray_node(4, ip="10.0.0.2"), ray_node(8, alive=False, ip="10.0.0.3"),
              ray_node(8, ip="10.0.0.4")]
    nodes, notes = cluster_nodes(listed)
    # the dead node and the CPU-only head are left out; the largest node first (learner ranks pack there)
    assert [(n.name, len(n.gpus)) for n in nodes] == [("10.0.0.4", 8), ("10.0.0.2", 4)]
    assert [g.index for g in nodes[1].gpus] == ["0", "1", "2", "3"] and nodes[0].gpus[0].name == "H100"
    assert nodes[0].gpus[0].memory_gb == DEFAULT_GPU_GB and "assumes 80 GiB per GPU" in notes[0]
    nodes, notes = cluster_nodes(listed, memory_gb=141)
    assert nodes[0].gpus[0].memory_gb == 141 and notes == []
    assert cluster_nodes([ray_node(0)])[0][0].gpus == []  # a CPU cluster: the plan is `cpu`
    assert cluster_nodes(listed, gpus="none")[0][0].gpus == []


def test_separate_layout_reserves_what_the_plan_gives_each_process():
    from launch.devices.gpus import parse_fake

    d = devices(parse_fake("8"), "--run.learner_ranks", "2", "--run.num_generators", "2",
                "--generator.tensor_parallel_size", "2", "--scorer.device", "cuda", "--run.placement", "separate")
    assert d.plan.layout == "separate" and not d.shared
    assert {k: d.gpus(k) for k in ("buffer", "weight_sync", "scorer", "generator", "learner")} == \
        {"buffer": 0, "weight_sync": 0, "scorer": 1, "generator": 2, "learner": 1}
    assert d.actor_bundle("generator") == {"CPU": 1.0, "GPU": 2.0} and d.gpu_bundles() == []
    # an explicit reservation wins (x the engine's tensor-parallel size); a CPU scorer reserves none
    d = devices(parse_fake("8"), "--generator.tensor_parallel_size", "2", "--ray.generator.num_gpus", "1",
                "--run.placement", "separate")
    assert d.gpus("generator") == 2 and d.gpus("scorer") == 0
    # a CPU cluster: nothing reserved unless asked
    d = devices(parse_fake("0"), "--ray.learner.num_gpus", "1")
    assert d.plan.layout == "cpu" and d.gpus("generator") == 0 and d.gpus("learner") == 1 and not d.gpu_cluster


def test_colocated_layout_holds_one_gpu_group_per_node_and_processes_reserve_none():
    from launch.devices.gpus import parse_fake

    d = devices(parse_fake("8"), "--run.learner_ranks", "4", "--run.num_generators", "2",
                "--generator.tensor_parallel_size", "2", "--run.num_scorers", "2", "--scorer.device", "cuda",
                "--run.placement", "colocate", *SMALL)
    assert d.shared and all(d.gpus(k) == 0 for k in ("scorer", "generator", "learner"))
    [(node, used, bundles)] = d.gpu_bundles()
    assert node == 0 and used == ["0", "1", "2", "3"]
    # each bundle: 1 GPU and the CPUs of the processes whose first device it is
    firsts = {dv: sum(1 for p in d.plan.placements if p.devices and p.devices[0] == dv) for dv in used}
    assert [b["GPU"] for b in bundles] == [1.0] * 4
    assert [round(b["CPU"], 2) for b in bundles] == [round(0.05 * firsts[dv], 2) for dv in used]
    assert sum(firsts.values()) == 4 + 2 + 2  # every planned process sits in one bundle
    assert d.seated("learner") and not d.seated("buffer")


def test_a_vllm_generator_without_a_gpu_on_a_gpu_cluster_is_refused():
    from launch.cluster.config import ResourceError
    from launch.cluster.devices import cluster_nodes
    from launch.devices.gpus import parse_fake

    with pytest.raises(ResourceError, match=r"ray.generator.num_gpus=0\).*pile onto GPU 0"):
        devices(parse_fake("8"), "--ray.generator.num_gpus", "0")
    with pytest.raises(ResourceError, match=r"a vLLM generator on a GPU cluster with no GPU.*run.gpus none"):
        devices(cluster_nodes([ray_node(8)], gpus="none")[0], "--run.gpus", "none", gpu_cluster=True)
    with pytest.raises(ResourceError, match=r"num_gpus=0.5 with generator.tensor_parallel_size 2"):
        devices(parse_fake("8"), "--ray.generator.num_gpus", "0.5", "--generator.tensor_parallel_size", "2")
    with pytest.raises(ResourceError, match=r"ray.learner.num_gpus=1 with run.placement colocate"):
        devices(parse_fake("8"), "--ray.learner.num_gpus", "1", "--run.placement", "colocate")
    # on a CPU cluster, or a generator that is not vLLM: fine
    devices(parse_fake("0"), "--ray.generator.num_gpus", "0")
    devices(parse_fake("8"), "--ray.generator.num_gpus", "0", "--generator.engine", "transformers")
    # a layout that does not fit: the plan's numbers
    with pytest.raises(ResourceError, match=r"need 10 GPU\(s\); 8 found"):
        devices(parse_fake("8"), "--run.learner_ranks", "8", "--run.num_generators", "2", "--run.placement", "separate")


def plan_cli(monkeypatch, capsys, fake: str, main, argv: list[str]) -> tuple[int, str, str]:
    monkeypatch.setenv("CONVEYOR_FAKE_GPUS", fake)
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_plan_of_openrlhfs_colocated_8_gpu_quick_start_fits_in_8_gpus(monkeypatch, capsys, tmp_path):
    from launch import train_ppo_ray

    code, out, err = plan_cli(monkeypatch, capsys, "8", train_ppo_ray.main,
                              [*QUICK_START, "--save_path", str(tmp_path / "ckpt"), "--plan"])
    assert code == 0, err
    assert out.startswith("device plan: colocate, 8 of 8 GPU(s) on 1 node(s)")
    for i in range(4):  # engines of 2 GPUs at OpenRLHF's share, each beside two learner ranks
        assert f"generator-{i}   node node0 gpu {2 * i},{2 * i + 1}" in out
        assert (f"<the ids Ray gave the bundles of gpu {2 * i},{2 * i + 1}> "
                "--generator.gpu_memory_utilization 0.600") in out
    assert all(f"learner-{r}     node node0 gpu {r} " in out for r in range(8))
    assert 'buffer        num_gpus 0: CUDA_VISIBLE_DEVICES=""' in out
    assert not (tmp_path / "ckpt").exists()  # nothing written, no cluster joined
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_plan_of_a_separate_layout_on_two_nodes_and_a_refusal(monkeypatch, capsys, tmp_path):
    from launch import ray as launcher

    flags = [*BASE, "--run.run_dir", str(tmp_path / "run"), "--run.learner_ranks", "8", "--run.num_generators", "3",
             "--generator.tensor_parallel_size", "2", "--run.num_scorers", "2", "--scorer.device", "cuda",
             "--run.placement", "separate", "--plan"]
    code, out, err = plan_cli(monkeypatch, capsys, "2x8", launcher.main, flags)
    assert code == 0, err
    assert out.startswith("device plan: separate, 16 of 16 GPU(s) on 2 node(s)")
    assert "generator-0   num_gpus 2: CUDA_VISIBLE_DEVICES=<the 2 ids Ray gives it>" in out
    assert "learner-7     num_gpus 1" in out and "scorer-1      num_gpus 1" in out
    code, out, err = plan_cli(monkeypatch, capsys, "8", launcher.main, flags)
    assert code == 2 and "need 16 GPU(s); 8 found" in err and out == ""
    assert not (tmp_path / "run").exists()


# ---- on a local Ray with 8 logical GPUs -----------------------------------------------------------

# a role process that says, in its ready record, what it was given, then waits to be stopped
REPORT = ("import os, sys, time; from common.ready import mark_ready; "
          "mark_ready('fake', cuda=os.environ.get('CUDA_VISIBLE_DEVICES'), "
          "cap=os.environ.get('CONVEYOR_CUDA_MEMORY_FRACTION'), local_rank=os.environ.get('LOCAL_RANK'), "
          "flags=sys.argv[1:]); time.sleep(600)")


@pytest.fixture(scope="module")
def ray_gpus():
    """A local Ray (2 CPUs, 8 logical GPUs) for the module; this test process is its driver."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False,
             configure_logging=False, namespace="conveyor")
    try:
        yield ray
    finally:
        ray.shutdown()


def fake_job(tmp_path, *flags: str):
    """A RayRun whose role processes report their devices (REPORT) instead of running the role."""
    from launch.cluster.run import RayRun
    from launch.process import PYTHON

    (tmp_path / "run").mkdir()
    rcfg, run = load("--run.run_dir", str(tmp_path / "run"), "--ray.placement_timeout_s", "15", *SMALL, *flags)
    said: list[str] = []
    job = RayRun(rcfg, run, quiet=True, say=said.append)
    add = job.add

    def add_reporting(spec, slot, seat=None):  # (every process: planned ones and those `scale` adds)
        spec.argv = [PYTHON, "-c", REPORT]
        return add(spec, slot, seat)

    job.add = add_reporting
    job.said = said
    return job


def reports(job, names=None, timeout_s: float = 60.0) -> dict[str, dict]:
    """Each process's ready record (what it was given), once every one in `names` has written it."""
    names = names or [p.name for p in job.procs]
    deadline = time.monotonic() + timeout_s
    while True:
        job.poll()
        got = {p.name: p.ready for p in job.procs if p.ready}
        if all(n in got for n in names):
            return got
        assert time.monotonic() < deadline, f"no ready record from {sorted(set(names) - set(got))}"
        time.sleep(0.2)


def settles(read, value, timeout_s: float = 20.0) -> None:
    """`read()` comes to `value` (Ray's resource view follows its nodes' reports)."""
    deadline = time.monotonic() + timeout_s
    while read() != value:
        assert time.monotonic() < deadline, f"{read()} != {value}"
        time.sleep(0.2)


def ids(text: str | None) -> list[str]:
    return [x for x in (text or "").split(",") if x]


@pytest.mark.slow
def test_separate_layout_each_process_sees_only_its_own_gpus(ray_gpus, tmp_path):
    from launch.cluster.scale import scale_to

    job = fake_job(tmp_path, "--run.learner_ranks", "2", "--run.num_generators", "1",
                   "--generator.tensor_parallel_size", "2", "--scorer.device", "cuda", "--run.placement", "separate")
    try:
        job.launch()
        got = reports(job)
        assert got["buffer"]["cuda"] == got["weight_sync"]["cuda"] == ""  # not unset: every GPU would show
        engine, scorer = ids(got["generator-0"]["cuda"]), ids(got["scorer-0"]["cuda"])
        ranks = [ids(got[f"learner-{r}"]["cuda"]) for r in range(2)]
        assert len(engine) == 2 and len(scorer) == 1 and ranks[0] == ranks[1] and len(ranks[0]) == 2
        assert [got[f"learner-{r}"]["local_rank"] for r in range(2)] == ["0", "1"]
        used = engine + scorer + ranks[0]
        assert len(set(used)) == 5, got  # disjoint by construction: Ray's own reservations
        assert got["generator-0"]["flags"] == ["--generator.gpu_memory_utilization", "0.900"]
        settles(lambda: ray_gpus.available_resources().get("GPU", 0), 3)
        # scale: a new generator reserves 2 GPUs of its own; a third does not fit in the last 1
        scale_to(job, 2)
        more = ids(reports(job, ["generator-1"])["generator-1"]["cuda"])
        assert len(more) == 2 and not set(more) & set(used), (more, used)
        scale_to(job, 3)
        assert "generator-2" not in [p.name for p in job.procs]
        assert any("cannot add a generator" in s and "staying at 2" in s for s in job.said), job.said
        assert ray_gpus.get(job.controller.wanted_generators.remote()) == 2
    finally:
        job.shutdown()


@pytest.mark.slow
def test_colocated_layout_processes_get_the_ids_of_their_planned_bundles(ray_gpus, tmp_path):
    from launch.cluster.scale import scale_to
    from launch.roles import State

    class Holder:  # (defined here: Ray sends it by value)
        def ids(self) -> list[str]:
            import ray

            return [str(g) for g in ray.get_gpu_ids()]

    holder = ray_gpus.remote(num_gpus=3, num_cpus=0)(Holder).remote()  # someone else's GPUs first
    held = set(ray_gpus.get(holder.ids.remote()))
    job = fake_job(tmp_path, "--run.learner_ranks", "4", "--run.num_generators", "2",
                   "--generator.tensor_parallel_size", "2", "--run.num_scorers", "2", "--scorer.device", "cuda",
                   "--run.placement", "colocate")
    try:
        job.launch()
        got = reports(job)
        plan, gpu_ids = job.devices.plan, job.placement.gpu_ids
        assert sorted(d for _, d in gpu_ids) == ["0", "1", "2", "3"] and len(set(gpu_ids.values())) == 4
        assert not set(gpu_ids.values()) & held  # Ray's ids, not the plan's indices
        for p in plan.placements:
            want = [gpu_ids[(p.node, d)] for d in p.devices]
            if p.kind == "learner":  # every rank sees the node's learner GPUs; LOCAL_RANK picks its own
                assert ids(got[p.role]["cuda"]) == [gpu_ids[(0, str(r))] for r in range(4)]
                assert ids(got[p.role]["cuda"])[int(got[p.role]["local_rank"])] == want[0]
            else:
                assert ids(got[p.role]["cuda"]) == want, (p.role, got[p.role])
            if p.kind == "generator":
                assert got[p.role]["flags"] == ["--generator.gpu_memory_utilization", f"{p.share:.3f}"]
            elif p.share:
                assert got[p.role]["cap"] == f"{p.share:.3f}"
        assert got["buffer"]["cuda"] == ""
        # the role actors reserved no GPU: only the holder's 3 and the group's 4 are taken
        settles(lambda: ray_gpus.available_resources().get("GPU", 0), 1)
        # scale: no room beyond the planned engines; a stopped one's seat is taken again
        scale_to(job, 3)
        assert any("shares the GPUs' memory out among the 2 generator(s)" in s and "staying at 2" in s
                   for s in job.said), job.said
        scale_to(job, 1)
        gen1 = next(p for p in job.procs if p.name == "generator-1")
        deadline = time.monotonic() + 60
        while gen1.state != State.STOPPED:
            assert time.monotonic() < deadline, "generator-1 did not stop"
            for name, (code, lost) in job.poll().items():
                if code is not None or lost:
                    job.exited(next(q for q in job.procs if q.name == name), code, lost)
            time.sleep(0.2)
        scale_to(job, 2)
        new = reports(job, ["generator-2"])["generator-2"]
        assert ids(new["cuda"]) == ids(got["generator-1"]["cuda"]) and new["flags"] == got["generator-1"]["flags"]
    finally:
        job.shutdown()
        ray_gpus.kill(holder)


@pytest.mark.slow
def test_a_vllm_generator_without_a_gpu_is_refused_before_anything_is_placed(ray_gpus, tmp_path):
    from launch.ray import attempt_code

    job = fake_job(tmp_path, "--ray.generator.num_gpus", "0")
    said: list[str] = []
    try:
        assert attempt_code(job.go, said.append) == 2
    finally:
        job.shutdown()
    assert "a vLLM generator on a GPU cluster with no GPU of its own" in said[-1]
    assert job.procs == [] and job.placement.groups == []

