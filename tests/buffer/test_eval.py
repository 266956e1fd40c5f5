"""Evaluation during training (buffer/eval.py): a real buffer process serves a round of evaluation
prompts to generators holding the evaluated version, at the evaluation temperature, apart from the
training stream; a generator that dies mid-round (its lease expires) is replaced; the report's
pass@1 / pass@k / reward mean are the ones worked out by hand, and the samples are on disk.
"""

import json
import time

import yaml

from buffer.eval import EVAL_GROUP_BASE
from buffer.messages import EvalReport, EvalRequest, Wait
from tests.helpers.buffer import answer, group_ids, scored, start_buffer


def _eval_buffer(tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(3)]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"eval": {"dataset": str(data), "n_samples_per_prompt": 2, "temperature": 0.0,
                                               "samples_dir": str(tmp_path / "eval")}}))
    return start_buffer(tmp_path, config=config, prompts_per_step=2, n_samples_per_prompt=3, lease_ttl_s=1.0,
                        max_staleness=1)


def test_an_evaluation_round_is_served_apart_from_training(tmp_path):
    b = _eval_buffer(tmp_path)
    with b.client() as c:
        wait = c.request(EvalRequest(0))
        assert isinstance(wait, Wait) and "evaluating version 0: 0/3 prompts done" in wait.reason
        # a generator at version 0 gets the evaluation first, at its temperature and sample count
        first = c.lease("gen-a", 2, version=0)
        assert first.temperature == 0.0 and first.n_samples == 2 and first.version == 0
        assert all(g.group_id >= EVAL_GROUP_BASE for g in first.groups) and len(first.groups) == 2
        second = c.lease("gen-b", 8, version=0)
        assert [g.prompt for g in second.groups] == ["2+2="] and second.groups[0].label == "4"
        assert c.submit_scored([scored(second.groups[0].group_id, i, second.lease_id, reward=1.0)
                                for i in range(2)]).accepted == 2
        # gen-a dies: its lease expires and the same two prompts go to the next generator at version 0
        time.sleep(1.2)
        again = c.lease("gen-b", 8, version=0)
        assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
        assert again.lease_id != first.lease_id
        late = c.submit_scored([scored(first.groups[0].group_id, 0, first.lease_id, reward=1.0)])
        assert late.accepted == 0  # the dead generator's answer comes too late
        a, bb = again.groups
        ack = c.submit_scored([scored(a.group_id, 0, again.lease_id, reward=1.0),
                               scored(a.group_id, 1, again.lease_id, reward=0.0),
                               scored(bb.group_id, 0, again.lease_id, reward=0.0),
                               scored(bb.group_id, 1, again.lease_id, reward=0.0)])
        assert ack.accepted == 4
        report = c.request(EvalRequest(0))
        assert isinstance(report, EvalReport) and report.version == 0
        v = report.values
        # 6 samples, 3 pass (1, 0 | 0, 0 | 1, 1); prompts with a pass among 2: 2 of 3
        assert (v["eval/pass@1"], round(v["eval/pass@k"], 6), v["eval/reward_mean"]) == (0.5, round(2 / 3, 6), 0.5)
        assert (v["eval/k"], v["eval/prompts"], v["eval/failed_prompts"]) == (2.0, 3.0, 0.0)
        assert c.request(EvalRequest(0)).values == v  # asked again: the same report
        # a round asked for and then left (the learner moved on, or resumed from an earlier
        # checkpoint) is replaced by the one asked for next, and counted
        assert isinstance(c.request(EvalRequest(3)), Wait) and isinstance(c.request(EvalRequest(2)), Wait)
        assert c.metrics()["buffer/eval_rounds_abandoned"] == 1
        assert isinstance(c.request(EvalRequest(0)), EvalReport)  # a finished round's report is kept
        rows = [json.loads(x) for x in (tmp_path / "eval" / "version_0.jsonl").read_text().splitlines()]
        assert [(r["index"], r["sample"], r["reward"]) for r in rows] == [(0, 0, 1.0), (0, 1, 0.0), (1, 0, 0.0),
                                                                          (1, 1, 0.0), (2, 0, 1.0), (2, 1, 1.0)]
        # no more evaluation leases: training goes on, and its stream never saw the round
        train = c.lease("gen-a", 2, version=0)
        assert train.temperature is None and [g.group_id for g in train.groups] == [0, 1]
        answer(c, train)
        assert group_ids(c.get_batch(0, timeout_s=10)) == [0, 1]
        m = c.metrics()
        assert m["buffer/eval_rounds"] == 3 and m["buffer/eval_samples"] == 6 and m["buffer/eval_expired_leases"] == 1
        assert m["buffer/accepted_groups"] == 2 and m["buffer/issued_groups"] == 2  # training groups only
    assert b.stop() == 0
