"""Sequence parallelism (`learner.sequence_parallel`, OpenRLHF's --ds.ring_attn_size): two gloo
ranks sharing every sequence compute what one rank holding whole sequences computes.

- The forward pieces, in two spawned processes on tiny Llamas (one with as many key/value heads as
  query heads, one with a single key/value head, which the split must repeat): log-probs,
  entropies and critic values equal the whole-sequence forward's, on right-padded and on packed
  rows, and the two ranks' gradients sum to the whole forward's gradient (each rank's loss counting
  half, as the learner counts it).
- The learner: two DeepSpeed ranks with sequence_parallel=2 (one data-parallel share) train the
  same weights as one rank on the same steps (GRPO padded under ZeRO-2, PPO with a critic on
  packed rows under ZeRO-3), and the ledger holds each group once.
- What is refused, with the reason: a group size that does not divide the ranks or the heads, the
  MoE router loss with it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from common.config import ConfigError
from learner.config import LearnerConfig
from learner.sequence_parallel import SequenceParallel
from tests.helpers.learner import ListSource, make_group, run_two_ranks

WORKER = r'''
import json, os, sys
import torch, torch.distributed as dist

rank, world, port, model_dir, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
backend = os.environ.get("CONVEYOR_SP_BACKEND", "gloo")  # nccl: bench/gpu_check.sh, one GPU a rank
device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend, rank=rank, world_size=world)
import learner.sequence_parallel as seqpar
from learner.engine import ValueModel
from learner.modeling import load_causal_lm, next_token_stats
from learner.packing import pack_rows
from transformers import LlamaConfig, LlamaForCausalLM

calls = []
attend = seqpar.ulysses_attention
def counted(*a, **k):
    calls.append(1)
    return attend(*a, **k)
seqpar.ulysses_attention = counted

sp = seqpar.SequenceParallel.create(2, rank, world)
torch.manual_seed(0)
gqa = LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16)).eval()
models = {"tiny": load_causal_lm(model_dir).to(device), "gqa": gqa.to(device)}
ids = torch.randint(4, 70, (4, 15), generator=torch.Generator().manual_seed(1))
attn = torch.ones_like(ids)
for b, n in enumerate([15, 9, 5, 12]):
    attn[b, n:] = 0
ids, attn = ids.to(device), attn.to(device)
mask = attn[:, 1:].bool()
weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)).to(device)
report = {}
for name, model in models.items():
    sp.check_model(model.config)
    for packed in (None, pack_rows(ids, attn, 20)):
        key = f"{name}/{'packed' if packed is not None else 'padded'}"
        out_ = {}
        for which, group in (("sp", sp), ("whole", None)):
            model.zero_grad()
            lp, ent = next_token_stats(model, ids, attn, 0.9, packed, entropy=True, sp=group)
            ((lp * weights)[mask].sum() + ent[mask].mean()).backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            if group is not None:
                dist.all_reduce(grads)  # the group's gradient: each rank's loss is 1/size of the share's
                grads /= sp.size
            out_[which] = (lp.detach(), ent.detach(), grads)
        (a, ae, ag), (b, be, bg) = out_["sp"], out_["whole"]
        report[key] = {"lp": float((a - b)[mask].abs().max()), "ent": float((ae - be)[mask].abs().max()),
                       "grad": float((ag - bg).abs().max()), "grad_norm": float(bg.norm())}
critic = ValueModel(model_dir).to(device)
torch.nn.init.normal_(critic.value_head.weight, std=0.1)
packed = pack_rows(ids, attn, 20)
v_sp = packed.unpack(sp.values(critic, packed.input_ids, packed.position_ids))
v = critic(ids, attn)
report["critic"] = {"v": float((v_sp - v)[attn.bool()].abs().max()),
                    "padded": float((sp.values(critic, ids, None) - v)[attn.bool()].abs().max())}
report["attention_calls"] = len(calls)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


def test_split_forward_and_gradient_equal_the_whole_sequence(tiny_model_dir, tmp_path):
    """(CONVEYOR_SP_BACKEND=nccl runs the same on two GPUs, one a rank: bench/gpu_check.sh.)"""
    from launch.ports import free_port_block
    from tests.helpers.procs import ROOT, subprocess_env

    (tmp_path / "worker.py").write_text(WORKER)
    port = str(free_port_block(1))
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(r), port, str(tiny_model_dir),
                               str(tmp_path)], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report.pop("attention_calls") > 0  # the split attention ran
        critic = report.pop("critic")
        assert critic["v"] < 1e-5 and critic["padded"] < 1e-5, critic
        assert set(report) == {"tiny/padded", "tiny/packed", "gqa/padded", "gqa/packed"}
        for key, d in report.items():
            assert d["lp"] < 1e-5 and d["ent"] < 1e-5, (key, d)
            assert d["grad"] < 1e-5 * max(1.0, d["grad_norm"]), (key, d)
            assert d["grad_norm"] > 1e-3, (key, d)  # a gradient to compare


# ------------------------------------------------------------------------------------------------
# the learner


TWO_RANKS = r'''
import sys
from learner.config import LearnerConfig
from learner.trainer import train
from tests.helpers.learner import ListSource
import json

model_dir, out, cases = sys.argv[-3:]  # (the launcher puts --local_rank=N first)
steps = {int(k): v for k, v in __import__("tests.learner.test_sequence_parallel", fromlist=["x"]).steps().items()}
for name, kw in json.loads(cases).items():
    cfg = LearnerConfig(model_path=model_dir, run_dir=f"{out}/{name}", sequence_parallel=2, **kw)
    train(cfg.validate(), source=ListSource(steps))
'''

CASES = {
    "grpo": dict(total_steps=2, advantage_estimator="grpo", lr=1e-3, adam_eps=1e-3, zero_stage=2, entropy_coef=0.01,
                 tensorboard=False),
    "ppo": dict(total_steps=1, advantage_estimator="gae", lr=1e-3, critic_lr=1e-3, adam_eps=1e-3, zero_stage=3,
                packing=True, num_mini_batches=2, tensorboard=False),
}


def steps() -> dict:
    return {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], seed=s, completion_len=(8, 30))
            + make_group(2 * s + 1, 4, [0.0, 0.3, 1.0, 1.0], seed=s, completion_len=(8, 30)) for s in range(2)}


def _trained(ckpt) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="state")


@pytest.mark.slow
def test_two_ranks_sharing_sequences_train_what_one_rank_trains(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from learner.ledger import LEDGER_NAME, read_ledger
    from learner.metrics import read_metrics
    from learner.trainer import train

    start = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, kw in CASES.items():
        # each case in processes of its own: a rank that trains a second time in the process it
        # trained in re-creates its process groups, which once aborted inside gloo ("terminate called
        # without an active exception") while the suite ran, never on its own
        run_two_ranks(TWO_RANKS, tmp_path, str(tiny_model_dir), str(tmp_path / "sp"), json.dumps({name: kw}),
                      timeout_s=400)
        train(LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path / "one" / name), **kw).validate(),
              source=ListSource(steps()))
        last = f"step_{kw['total_steps']}"
        split, whole = (_trained(tmp_path / run / name / "checkpoints" / last) for run in ("sp", "one"))
        assert split.keys() == whole.keys()
        for n in whole:
            assert torch.allclose(split[n], whole[n], atol=1e-5), (name, n, (split[n] - whole[n]).abs().max())
        m_split, m_whole = read_metrics(tmp_path / "sp" / name), read_metrics(tmp_path / "one" / name)
        for a, b in zip(m_split, m_whole):
            assert a["perf/tokens"] == b["perf/tokens"] and a["perf/samples"] == b["perf/samples"] == 8
            assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-6)
            assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-4)
        ledger = read_ledger(tmp_path / "sp" / name / LEDGER_NAME)  # each step's two groups, once
        assert ledger == {k: [2 * k, 2 * k + 1] for k in range(kw["total_steps"])}
        assert max((whole[n] - start[n]).abs().max() for n in start) > 1e-4  # the steps moved the weights


# ------------------------------------------------------------------------------------------------
# refusals


def test_a_group_that_does_not_divide_is_refused():
    from types import SimpleNamespace

    sp = SequenceParallel(size=3, index=0, leader=0, group=None, share=0, shares=1)
    with pytest.raises(ValueError, match="num_attention_heads=2"):
        sp.check_model(SimpleNamespace(num_attention_heads=2))
    with pytest.raises(ValueError, match="does not divide the 4 learner rank"):
        SequenceParallel.create(3, 0, 4)
    with pytest.raises(ConfigError, match="aux_loss_coef"):
        LearnerConfig(sequence_parallel=2, aux_loss_coef=0.01).validate()


def test_run_config_counts_shares_not_ranks(tiny_model_dir, tmp_path):
    from launch.run_config import load_run_config
    from tests.helpers.procs import ROOT

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    base = [f"--learner.model_path={tiny_model_dir}", f"--buffer.prompts={prompts}", "--run.learner_ranks=4",
            f"--scorer.reward_fn={ROOT}/examples/rewards/arithmetic.py"]
    # 2 prompt groups over 4 ranks in groups of 2: two shares, one group each
    cfg = load_run_config(None, base + ["--learner.sequence_parallel=2", "--buffer.prompts_per_step=2"])
    assert cfg.learner.sequence_parallel == 2
    with pytest.raises(ConfigError, match="does not divide run.learner_ranks=4"):
        load_run_config(None, base + ["--learner.sequence_parallel=3", "--buffer.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="not divisible by the 2 learner share"):
        load_run_config(None, base + ["--learner.sequence_parallel=2", "--buffer.prompts_per_step=3"])

