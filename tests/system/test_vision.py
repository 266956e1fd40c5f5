"""A vision-language policy end to end: the tiny Qwen2-VL through `launch.local` with a vLLM
generator, a scorer (reward and the reference's log-probs, with the pictures), a DeepSpeed learner
and weight sync, on image prompts read from a Parquet file (image structs) and evaluated on a
JSONL file (base64 pictures).

What is checked: the run completes with a clean ledger; at staleness 0 the learner's log-probs of
the rollouts (computed with the pictures' pixels) equal the engine's (behaviour vs pi_old KL near
0, as on the text path); after weight rounds the engine's greedy answers (the run's own
evaluations) are transformers' greedy answers on the checkpoints; a run with the vision tower
frozen sends rounds without it, and its checkpoint's vision tower is the start's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import run_local_config
from tests.helpers.procs import ROOT

pytestmark = pytest.mark.slow

VISION_YAML = ROOT / "examples" / "vision.yaml"
WARM_STEPS = 150  # peaked enough that greedy answers are not near-ties
HELDOUT = 60


@pytest.fixture(scope="module")
def vision_setup(tmp_path_factory):
    from demo.tiny_vlm import build_tiny_vlm
    from demo.vision import make_rows, warm_start, write_jsonl, write_parquet

    d = tmp_path_factory.mktemp("vision")
    heldout = make_rows(HELDOUT, seed=10_000)
    train = make_rows(600, seed=0)
    warm = warm_start(build_tiny_vlm(d / "base", seed=0), d / "warm", train, WARM_STEPS, seed=0, log_every=0)
    return {"dir": d, "warm": warm, "heldout": heldout, "prompts": write_parquet(train, d / "train.parquet"),
            "heldout_path": write_jsonl(heldout, d / "heldout.jsonl")}


def run_local(run_dir: Path, setup: dict, *extra: str, timeout: float = 900) -> tuple[int, str, list[dict]]:
    return run_local_config(VISION_YAML, run_dir, setup["warm"], setup["prompts"], *extra, timeout=timeout)


@pytest.fixture(scope="module")
def vision_run(vision_setup):
    """10 async GRPO steps with a KL term (the scorer's reference is the vision-language warm
    start), evaluated greedily every 5 steps."""
    run_dir = vision_setup["dir"] / "run"
    t0 = time.monotonic()
    code, out, rows = run_local(
        run_dir, vision_setup, "--learner.total_steps", "10", "--learner.save_every", "5", "--learner.kl_coef", "0.001",
        "--eval.dataset", str(vision_setup["heldout_path"]), "--eval.every", "5",
        "--eval.n_samples_per_prompt", "1", "--eval.temperature", "0")
    return {"dir": run_dir, "code": code, "out": out, "wall_s": time.monotonic() - t0,
            "rows": [r for r in rows if "loss/policy" in r], "eval": {r["step"]: r for r in rows if "eval/pass@1" in r}}


def test_a_run_on_image_prompts_completes_and_the_learner_agrees_with_the_engine(vision_run):
    assert vision_run["code"] == 0, vision_run["out"]
    rows = vision_run["rows"]
    assert [r["step"] for r in rows] == list(range(10))
    groups = [g for line in (vision_run["dir"] / "ledger.jsonl").read_text().splitlines()
              for g in json.loads(line).get("groups", [])]
    assert groups and len(groups) == len(set(groups)), "a group was trained twice"
    # the reference (the warm start, with the pictures) is step 0's pi_old; later steps move away
    assert abs(rows[0]["policy/kl_to_ref"]) < 1e-4, rows[0]["policy/kl_to_ref"]
    # staleness 0: the engine sampled with the weights of the learner's pi_old; with the same pixels
    # their log-probs differ by floating-point order only (the text demo's level)
    fresh = [r for r in rows if r["buffer/staleness_max"] == 0]
    assert fresh, [r["buffer/staleness_max"] for r in rows]
    for r in fresh:
        assert r["policy/behav_prox_kl"] < 1e-3, r["policy/behav_prox_kl"]


def test_after_rounds_the_engine_answers_pictures_as_transformers_does_on_the_checkpoints(vision_run, vision_setup):
    from demo.vision import answer_of, greedy_answers

    assert sorted(vision_run["eval"]) == [0, 5, 10], sorted(vision_run["eval"])
    for step in (5, 10):
        offline = greedy_answers(vision_run["dir"] / "checkpoints" / f"step_{step}", vision_setup["heldout"])
        samples = vision_run["dir"] / "eval" / f"version_{step}.jsonl"
        online = {r["index"]: answer_of(r["completion"]) for r in map(json.loads, samples.read_text().splitlines())}
        assert sorted(online) == list(range(HELDOUT))
        same = sum(online[i] == a for i, a in enumerate(offline))
        assert same >= HELDOUT - 2, f"step {step}: {HELDOUT - same} of {HELDOUT} greedy answers differ"


def test_a_frozen_vision_tower_is_never_sent_and_never_changes(vision_setup):
    import torch
    from safetensors.torch import load_file

    run_dir = vision_setup["dir"] / "frozen"
    code, out, rows = run_local(run_dir, vision_setup, "--learner.total_steps", "3", "--learner.save_every", "3",
                                "--learner.freeze_visual_encoder", "true")
    assert code == 0, out
    rows = [r for r in rows if "loss/policy" in r]
    start = load_file(str(Path(vision_setup["warm"]) / "model.safetensors"))
    end = load_file(str(run_dir / "checkpoints" / "step_3" / "model.safetensors"))
    assert set(start) == set(end)
    tower = [n for n in start if n.startswith("visual.")]
    assert tower and all(torch.equal(start[n], end[n]) for n in tower)
    assert any(not torch.equal(start[n], end[n]) for n in start if n.startswith("model.layers."))
    full = sum(t.numel() * t.element_size() for t in start.values())
    without = full - sum(start[n].numel() * start[n].element_size() for n in tower)
    synced = [r["sync/bytes"] for r in rows if "sync/bytes" in r]
    assert synced and all(b <= without for b in synced), (synced, without, full)
