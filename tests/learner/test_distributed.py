"""Two learner ranks (gloo, ZeRO-2 and ZeRO-3) training from a live buffer process.

The test starts `python -m launch.buffer`, plays generator + scorer itself (takes a lease of 8
prompt groups, pushes fabricated scored rollouts answering it), then launches two ranks with
`deepspeed --num_gpus 2` running `launch.learner`. A small driver around `launch.learner.main`
records, per rank, which groups its shares held and a hash of its full parameters after the final
checkpoint. Asserted: rank 0 signalled ready (the ready file) for a world of two, the shares are
disjoint whole groups covering each step's batch, both ranks end with identical weights, the HF \
checkpoint holds exactly those weights, and the buffer was told
the new version.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer.client import BufferClient
from buffer.messages import LeaseGrant
from common.ready import read_ready
from launch.ports import free_port_block
from tests.helpers.learner import make_group
from tests.helpers.procs import ROOT, subprocess_env

PROMPTS_PER_STEP, N_SAMPLES, STEPS = 4, 2, 2

DRIVER = r'''
import hashlib, json, os, sys
from pathlib import Path

import deepspeed
import torch.distributed as dist

import learner.trainer as trainer
from buffer.client import BufferClient
from launch.learner import main
from tests.helpers.learner import make_group

out = Path(os.environ["TEST_OUT"])


def full_param_hash(engine):
    """sha256 over (name, fp32 bytes) of every parameter, names sorted; ZeRO-3 gathers each first."""
    h = hashlib.sha256()
    params = dict(engine.module.named_parameters())
    for name in sorted(params):
        p = params[name]
        with deepspeed.zero.GatheredParameters([p], enabled=engine.zero_optimization_stage() == 3):
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


save = trainer.save_checkpoint


def save_and_hash(run_dir, step, policy, *args, **kwargs):
    folder = save(run_dir, step, policy, *args, **kwargs)
    (out / f"hash_step{step}_rank{dist.get_rank()}.txt").write_text(full_param_hash(policy))
    return folder


get_batch = BufferClient.get_batch


def get_and_record(self, step, rank=0, world_size=1, **kwargs):
    batch = get_batch(self, step, rank, world_size, **kwargs)
    groups = sorted({s.rollout.group_id for s in batch.scored})
    with open(out / f"shares_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "world_size": world_size, "groups": groups, "n": len(batch.scored)}) + "\n")
    return batch


trainer.save_checkpoint = save_and_hash
BufferClient.get_batch = get_and_record
main(sys.argv[1:])
'''


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = subprocess_env()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _start_buffer(config: Path, port: int, log_path: Path) -> subprocess.Popen:
    """`python -m launch.buffer`, ready once its control port answers a metrics request."""
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "launch.buffer", str(config)], env=_env(),
                             stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    probe = BufferClient("127.0.0.1", port, timeout_s=1.0)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and p.poll() is None:
            try:
                probe.metrics()
                return p
            except (TimeoutError, OSError):
                continue
    finally:
        probe.close()
    p.kill()
    raise AssertionError(f"buffer did not come up (exit {p.poll()}): {log_path.read_text()[-2000:]}")


def _fill(client: BufferClient, groups: int) -> None:
    """Generator + scorer in one: lease `groups` prompt groups and push a scored answer for each."""
    leased = []
    deadline = time.monotonic() + 30
    while len(leased) < groups and time.monotonic() < deadline:
        grant = client.lease("test-producer", max_groups=groups - len(leased), version=0)
        if not isinstance(grant, LeaseGrant):
            time.sleep(0.05)
            continue
        for g in grant.groups:
            rewards = [float((g.group_id + i) % 2) for i in range(grant.n_samples)]  # one right, one wrong
            client.push_scored(make_group(g.group_id, grant.n_samples, rewards, version=0, seed=g.group_id,
                                          lease_id=grant.lease_id))
            leased.append(g.group_id)
    assert len(leased) == groups, f"leased {leased}"
    while client.metrics().get("buffer/queued_groups", 0) < groups:
        assert time.monotonic() < deadline, client.metrics()
        time.sleep(0.05)


def _checkpoint_hash(folder: Path) -> str:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].float().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_train_from_live_buffer(tiny_model_dir, tmp_path, zero_stage):
    port = free_port_block(4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a + 1}=", "label": str(2 * a + 1)}) + "\n"
                               for a in range(PROMPTS_PER_STEP * STEPS)))
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"""# deepspeed --num_gpus 2 --module launch.learner {config.name}
buffer:
  port: {port}
  prompts: {prompts}
  prompts_per_step: {PROMPTS_PER_STEP}
  n_samples_per_prompt: {N_SAMPLES}
  max_staleness: 1
learner:
  model_path: {tiny_model_dir}
  run_dir: {run_dir}
  total_steps: {STEPS}
  advantage_estimator: grpo
  lr: 1.0e-3
  zero_stage: {zero_stage}
  gradient_accumulation_steps: 2
  tensorboard: false
  batch_timeout_s: 60
""")
    buffer = _start_buffer(config, port, tmp_path / "buffer.log")
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    try:
        _fill(client, PROMPTS_PER_STEP * STEPS)
        driver = tmp_path / "driver.py"
        driver.write_text(DRIVER)
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
               "--master_port", str(free_port_block(1)), str(driver), str(config)]
        ready_file = tmp_path / "learner.ready"
        env = _env({"TEST_OUT": str(tmp_path), "CONVEYOR_READY_FILE": str(ready_file)})
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-4000:]
        ready = read_ready(ready_file)  # rank 0 said so once both ranks had built their engines
        assert ready and (ready["role"], ready["world"], ready["step"]) == ("learner", 2, 0), ready
        buffer_version = client.metrics()["buffer/version"]
    finally:
        client.close()
        buffer.terminate()
        buffer.wait(timeout=30)

    # disjoint whole groups, together the step's batch
    shares = {r: [json.loads(line) for line in (tmp_path / f"shares_rank{r}.jsonl").read_text().splitlines()]
              for r in (0, 1)}
    for step in range(STEPS):
        g0 = set(shares[0][step]["groups"])
        g1 = set(shares[1][step]["groups"])
        assert shares[0][step]["step"] == shares[1][step]["step"] == step
        assert shares[0][step]["world_size"] == shares[1][step]["world_size"] == 2
        assert g0 and g1 and not g0 & g1
        assert len(g0 | g1) == PROMPTS_PER_STEP
        assert shares[0][step]["n"] == len(g0) * N_SAMPLES and shares[1][step]["n"] == len(g1) * N_SAMPLES

    # identical weights on both ranks, the ones the HF checkpoint holds, changed by training
    h0 = (tmp_path / f"hash_step{STEPS}_rank0.txt").read_text()
    h1 = (tmp_path / f"hash_step{STEPS}_rank1.txt").read_text()
    assert h0 == h1
    assert _checkpoint_hash(run_dir / "checkpoints" / f"step_{STEPS}") == h0
    assert _checkpoint_hash(tiny_model_dir) != h0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[0]["buffer/staleness_max"] == 0 and rows[1]["buffer/staleness_max"] == 1  # all tokens v0
    assert rows[0]["perf/samples"] == PROMPTS_PER_STEP * N_SAMPLES  # summed over both ranks
    assert all(r["optim/grad_norm"] > 0 for r in rows)
    assert buffer_version == STEPS
