"""The device plan (launch/devices/): layouts for 1-8 GPUs on a node and 2 nodes x 8, shares that
fit, refusals with the numbers, and every role process's environment carrying its devices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch.devices.gpus import Gpu, Node, PlanError, local_gpus, parse_fake
from launch.devices.memory import GIB, Demand, ModelSize, learner_gb, model_size, params_from_config
from launch.devices.plan import USABLE, make_plan
from tests.helpers.procs import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
REWARD = str(ROOT / "demo" / "arithmetic.py")
LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def nodes(n_gpus: int, gb: float = 80.0, n_nodes: int = 1) -> list[Node]:
    return [Node(f"node{k}", [Gpu(str(i), gb) for i in range(n_gpus)]) for k in range(n_nodes)]


def demand(ranks=1, gens=1, tp=1, scorers=0, params_b=0.5, zero=2, dtype="bfloat16", share=0.0, lora=False,
           scorer_gb=3.0) -> Demand:
    size = ModelSize(int(params_b * 1e9), 24, 2 * 24 * 8 * 64 * 2)
    lgb, parts = learner_gb(size, ranks, zero, dtype, lora)
    engine = size.params * 2 / tp / GIB + 0.5 + 2.0
    return Demand(ranks, gens, tp, scorers, True, share, tuple(lgb + 2.75 for _ in range(ranks)), parts,
                  0.0, engine, "engine", 0.5 + 0.75, scorer_gb if scorers else 0.0, "scorer", True)


def check_fits(plan) -> None:
    """Every device: its processes' estimates (engines: their share and what comes on top) within
    what the plan hands out, and shares that sum below 1."""
    for (k, index), on in plan.device_load().items():
        mem = next(g.memory_gb for g in plan.nodes[k].gpus if g.index == index)
        shares = sum(p.share for p in on if p.kind == "generator")
        others = sum(p.need_gb for p in on if p.kind != "generator")
        assert shares * mem + others <= mem * USABLE + 1e-6, (index, [(p.role, p.share, p.need_gb) for p in on])
        caps = sum(p.share for p in on)
        assert caps < 1.0, (index, [(p.role, p.share) for p in on])


def disjoint(plan) -> bool:
    seen = set()
    for p in plan.placements:
        for dv in p.devices:
            if (p.node, dv) in seen:
                return False
            seen.add((p.node, dv))
    return True


# ---- model sizes ----------------------------------------------------------------------------------


def test_llama3_8b_parameters_from_its_config():
    # embeddings 128256 x 4096 twice (untied) = 1.05e9; per layer q,o 2 x 4096^2 + k,v 2 x 4096 x 1024
    # + MLP 3 x 4096 x 14336 + norms = 218.1e6, x 32 = 6.98e9: 8.03e9 in all
    assert params_from_config(LLAMA3_8B) == pytest.approx(8.03e9, rel=0.002)


def test_moe_counts_every_expert():
    mixtral = {**LLAMA3_8B, "vocab_size": 32000, "intermediate_size": 14336, "num_local_experts": 8}
    # 8 experts of 3 x 4096 x 14336 per layer: ~46.7e9 with attention and embeddings (Mixtral 8x7B)
    assert params_from_config(mixtral) == pytest.approx(46.7e9, rel=0.01)


def test_size_from_safetensors_headers_is_exact(tiny_model_dir):
    from safetensors.torch import load_file

    size = model_size(str(tiny_model_dir))
    tensors = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert size.params == sum(t.numel() for t in tensors.values())
    assert size.largest == max(t.numel() for t in tensors.values())  # a weight round's bucket holds it whole
    assert size.source == "safetensors headers"
    assert size.layers == 2 and size.kv_bytes_per_token > 0


def test_a_folder_elsewhere_is_unknown_unless_the_size_is_given(tmp_path):
    assert model_size(str(tmp_path / "absent")) is None
    assert model_size(str(tmp_path / "absent"), params_b=8).params == 8_000_000_000


def test_adam_costs_16_bytes_a_parameter_sharded_by_zero_stage():
    size = ModelSize(10**9)
    whole, _ = learner_gb(size, 1, 0, "bfloat16", False)
    assert whole * GIB == pytest.approx(16e9)
    z3, _ = learner_gb(size, 8, 3, "bfloat16", False)
    assert z3 * GIB == pytest.approx(16e9 / 8)
    z2, _ = learner_gb(size, 8, 2, "bfloat16", False)  # weights whole, gradients and Adam sharded
    assert z2 * GIB == pytest.approx(2e9 + 14e9 / 8)
    lora, _ = learner_gb(size, 1, 2, "bfloat16", True)
    assert lora * GIB == pytest.approx(2e9)


# ---- layouts ----------------------------------------------------------------------------------------


def test_one_gpu_learner_and_engine_share_it_with_shares_that_fit():
    plan = make_plan(demand(), nodes(1))
    assert plan.layout == "colocate"
    gen, learner = plan.of("generator-0"), plan.of("learner-0")
    assert gen.devices == learner.devices == ["0"]
    assert 0.05 < gen.share < 0.95 and 0 < learner.share < 1
    check_fits(plan)
    assert learner.after == "generator-0" and plan.waited() == {"generator-0"}
    env = plan.env("learner")
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and 0 < float(env["CONVEYOR_CUDA_MEMORY_FRACTION"]) < 1
    assert plan.overrides("generator-0") == ["--generator.gpu_memory_utilization", f"{gen.share:.3f}"]


def test_one_gpu_too_small_is_refused_with_the_numbers():
    with pytest.raises(PlanError) as e:
        make_plan(demand(params_b=8, dtype="float32", zero=0), nodes(1, gb=24))
    msg = str(e.value)
    assert "gpu 0" in msg and "24 GiB" in msg and "needs" in msg and "Turn:" in msg


@pytest.mark.parametrize("n_gpus, ranks, gens, tp", [(2, 1, 1, 1), (4, 2, 1, 2), (8, 4, 2, 2), (8, 2, 3, 2)])
def test_one_node_with_enough_gpus_gives_every_process_its_own(n_gpus, ranks, gens, tp):
    plan = make_plan(demand(ranks, gens, tp), nodes(n_gpus))
    assert plan.layout == "separate" and disjoint(plan)
    for i in range(gens):
        devs = [int(x) for x in plan.of(f"generator-{i}").devices]
        assert len(devs) == tp and devs == list(range(devs[0], devs[0] + tp)) and devs[0] % tp == 0  # adjacent, aligned
        assert plan.of(f"generator-{i}").share == pytest.approx(0.9)
    assert [plan.of(f"learner-{r}").devices for r in range(ranks)] == [[str(r)] for r in range(ranks)]
    assert plan.env("learner")["CUDA_VISIBLE_DEVICES"] == ",".join(str(r) for r in range(ranks))
    assert "CONVEYOR_CUDA_MEMORY_FRACTION" not in plan.env("learner")  # alone on its devices: no cap
    assert plan.waited() == set()
    check_fits(plan)


def test_separate_asked_for_on_too_few_gpus_is_refused():
    with pytest.raises(PlanError, match=r"need 6 GPU\(s\); 4 found"):
        make_plan(demand(2, 2, 2), nodes(4), placement="separate")


def test_two_nodes_of_8_engines_and_learner_apart_scorers_on_the_learner_gpus():
    plan = make_plan(demand(8, 4, 2, scorers=2), nodes(8, n_nodes=2))
    assert plan.layout == "colocate_scorers"  # 8 + 4 x 2 + 2 = 18 > 16
    assert all(plan.of(f"learner-{r}").node == 0 for r in range(8))
    for i in range(4):
        g = plan.of(f"generator-{i}")
        assert g.node == 1 and len(g.devices) == 2 and int(g.devices[0]) % 2 == 0
    # scorers from the learner's last devices (rank 0's holds the weight-sync slot)
    assert [plan.of(f"scorer-{i}").devices for i in range(2)] == [["7"], ["6"]]
    assert plan.of("learner-7").after == "scorer-0"
    check_fits(plan)


def test_openrlhf_colocated_quick_start_fits_in_8():
    # --actor.num_gpus_per_node 8 --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all
    # --vllm.gpu_memory_utilization 0.6, a 1.5B policy
    plan = make_plan(demand(8, 4, 2, params_b=1.5, zero=3, share=0.6), nodes(8), placement="colocate")
    assert plan.layout == "colocate"
    assert sorted(dv for i in range(4) for dv in plan.of(f"generator-{i}").devices) == [str(i) for i in range(8)]
    assert all(plan.of(f"generator-{i}").share == 0.6 for i in range(4))
    check_fits(plan)
    assert all(0 < plan.of(f"learner-{r}").share <= USABLE - 0.6 for r in range(8))


def test_more_engines_than_devices_stack_with_split_shares():
    plan = make_plan(demand(2, 4, 1), nodes(2), placement="colocate")
    per_device = plan.device_load()
    assert all(sum(p.kind == "generator" for p in on) == 2 for on in per_device.values())
    check_fits(plan)


def test_a_given_share_that_leaves_the_learner_no_room_is_refused():
    with pytest.raises(PlanError, match="needs"):
        make_plan(demand(1, 1, 1, params_b=3, share=0.9), nodes(1))


def test_unknown_sizes_still_assign_devices_and_say_so():
    d = demand(2, 1, 1)
    d = Demand(**{**d.__dict__, "checked": False})
    plan = make_plan(d, nodes(2), placement="colocate")
    assert plan.memory_checked is False and "memory not checked" in plan.table()
    assert plan.of("generator-0").share < 0.5  # an even split, not everything to vLLM


def test_no_gpu_plans_nothing():
    plan = make_plan(demand(), [Node("local", [])])
    assert plan.layout == "cpu" and plan.env("generator-0") == {} and plan.overrides("generator-0") == []


# ---- finding GPUs ------------------------------------------------------------------------------------


def test_fake_gpus_and_the_launcher_s_own_visible_devices():
    two = parse_fake("2x8:141")
    assert len(two) == 2 and len(two[1].gpus) == 8 and two[0].gpus[0].memory_gb == 141
    assert [g.index for g in local_gpus("auto", environ={"CONVEYOR_FAKE_GPUS": "4"})[0].gpus] == ["0", "1", "2", "3"]
    assert local_gpus("none", environ={"CONVEYOR_FAKE_GPUS": "4"})[0].gpus == []
    assert [g.index for g in local_gpus("2,3", environ={"CONVEYOR_FAKE_GPUS": "4"})[0].gpus] == ["2", "3"]
    with pytest.raises(PlanError):
        parse_fake("eight")
    with pytest.raises(PlanError, match="no GPU 9"):
        local_gpus("1,9", environ={"CONVEYOR_FAKE_GPUS": "4"})


def test_a_launcher_restricted_to_some_gpus_plans_on_those_alone():
    # a scheduler gave the launcher GPUs 4-7 of 8: the plan uses those, under their own ids, each once
    fake = {"CONVEYOR_FAKE_GPUS": "8", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    gpus = local_gpus("auto", environ=fake)
    assert [g.index for g in gpus[0].gpus] == ["4", "5", "6", "7"]
    plan = make_plan(demand(2, 1, 2), gpus)
    ids = [dv for p in plan.placements for dv in p.devices]
    assert sorted(ids) == ["4", "5", "6", "7"] and disjoint(plan)
    assert plan.env("generator-0") == {"CUDA_VISIBLE_DEVICES": ",".join(plan.of("generator-0").devices),
                                       "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert [g.index for g in local_gpus("auto", environ={**fake, "CUDA_VISIBLE_DEVICES": "1,3"})[0].gpus] == ["1", "3"]
    assert local_gpus("auto", environ={**fake, "CUDA_VISIBLE_DEVICES": ""})[0].gpus == []


# ---- the launcher: every role process's environment ---------------------------------------------------


def test_every_role_process_gets_its_devices(quick_start_files, monkeypatch):
    from launch.local import device_plan
    from launch.roles import RestartPolicy, plan
    from launch.run_config import load_run_config

    monkeypatch.setenv("CONVEYOR_FAKE_GPUS", "4")
    run = load_run_config(None, ["--learner.model_path", quick_start_files["model"], "--buffer.prompts",
                                 quick_start_files["prompts"], "--scorer.reward_fn", REWARD,
                                 "--run.num_generators", "2", "--run.learner_ranks", "2",
                                 "--buffer.prompts_per_step", "4"])
    devices = device_plan(run)
    specs = {s.name: s for s in plan(run, "local", RestartPolicy(), devices)}
    assert specs["buffer"].env["CUDA_VISIBLE_DEVICES"] == "" and specs["weight_sync"].env["CUDA_VISIBLE_DEVICES"] == ""
    gens = [specs[f"generator-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(2)]
    learner = specs["learner"].env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(learner) == 2 and not set(learner) & set(gens) and len(set(gens)) == 2
    assert specs["generator-0"].argv[-2:] == ["--generator.gpu_memory_utilization", "0.900"]
    assert all(s.env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1" for s in specs.values())
    # the processes that join weight-sync NCCL groups start with what those groups need
    assert all(specs[n].env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] for n in ("learner", "generator-0", "generator-1"))
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT" not in specs["buffer"].env
    monkeypatch.setenv("CONVEYOR_FAKE_GPUS", "2")  # two GPUs: each engine shares a rank's, and starts before it
    specs = {s.name: s for s in plan(run, "local", RestartPolicy(), device_plan(run))}
    assert specs["generator-0"].ready.wait and specs["generator-1"].ready.wait
    assert float(specs["learner"].env["CONVEYOR_CUDA_MEMORY_FRACTION"]) > 0


def test_a_cpu_run_is_left_as_it_was(quick_start_files, monkeypatch):
    from launch.local import device_plan
    from launch.roles import RestartPolicy, plan
    from launch.run_config import load_run_config

    monkeypatch.delenv("CONVEYOR_FAKE_GPUS", raising=False)
    run = load_run_config(None, ["--learner.model_path", quick_start_files["model"], "--buffer.prompts",
                                 quick_start_files["prompts"], "--scorer.reward_fn", REWARD, "--run.gpus", "none"])
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in plan(run, "local", RestartPolicy(), device_plan(run)))


def run_plan(*args: str, fake: str = "8") -> subprocess.CompletedProcess:

    env = {**subprocess_env(), "CONVEYOR_FAKE_GPUS": fake}
    return subprocess.run([sys.executable, "-m", "launch.local", *args, "--plan"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_8_gpu_example_plans_and_a_70b_policy_is_refused():
    out = run_plan("examples/gpu_ppo_llama3_8b.yaml", "--run.model_params_b", "8")
    assert out.returncode == 0, out.stderr
    assert "device plan:" in out.stdout and "of 8 GPU(s)" in out.stdout and "memory not checked" not in out.stdout
    assert "generator-0" in out.stdout and "CUDA_VISIBLE_DEVICES=" in out.stdout
    big = run_plan("examples/gpu_ppo_llama3_8b.yaml", "--run.model_params_b", "70")
    assert big.returncode == 2 and "does not fit" in big.stderr and "GiB" in big.stderr


def test_a_gpu_scorers_teacher_is_in_its_memory_budget(quick_start_files, tmp_path):
    """On-policy distillation's teacher lives in the scorer: its weights count in the scorer's share."""
    from launch.devices.memory import demand_of
    from launch.run_config import load_run_config

    base = ["--learner.model_path", quick_start_files["model"], "--buffer.prompts", quick_start_files["prompts"],
            "--scorer.device", "cuda", "--scorer.reward_fn", REWARD]
    plain = demand_of(load_run_config(None, base))
    distill = demand_of(load_run_config(None, [*base, "--scorer.kinds", "reward_fn,teacher", "--scorer.teacher",
                                               quick_start_files["model"], "--learner.distill_coef", "1"]))
    assert "teacher" in distill.scorer_parts and "teacher" not in plain.scorer_parts
    assert distill.scorer_gb > plain.scorer_gb
