"""`python -m launch.serve_rm`: the tiny reward model behind HTTP, asked by OpenRLHF's client and by
Conveyor's (`RemoteReward`'s body), compared with the model scoring the same texts itself.

Two server processes serve the module: `normed` (OpenRLHF's flags, normalisation with the mean/std
written into the folder's config.json, batches gathered for up to 300 ms) and `guarded` (a bearer
token from the environment, raw scores). The flag table is checked against OpenRLHF 0.11.2's
serve_rm parser (tests/fixtures/openrlhf_0.11.2_serve_rm.json, read once from its wheel).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from actors.reward_server import RequestError, RewardServerConfig, parse_request
from common.config import ConfigError
from common.ready import ENV as READY_ENV
from common.ready import read_ready
from launch.entry import role_config
from launch.ports import free_port_block
from launch.serve_rm import SERVE_RM_FLAGS
from tests.helpers.procs import ROOT, stop, subprocess_env

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "openrlhf_0.11.2_serve_rm.json").read_text())
MEAN, STD = 0.25, 2.0
TOKEN = "test-token-7f3a"
# decoded prompt + completion as OpenRLHF's executor sends them: special tokens kept in the text
QUERIES = ["<s>12+34=46", "<s>hello world, a longer completion", "<s>7*8=56", "<s>x"]


def parse(*argv: str) -> RewardServerConfig:
    return role_config(RewardServerConfig, "serve_rm", list(argv), SERVE_RM_FLAGS)


def sample(opt: dict) -> list[str]:
    """The flag with a value an OpenRLHF user would give it (not its default where it has a value)."""
    if opt["action"] == "store_true":
        return [opt["flag"]]
    if opt["choices"]:
        return [opt["flag"], opt["choices"][-1]]
    return [opt["flag"], {"int": "4096", "str": "eager"}[opt["type"]]]


def test_every_serve_rm_flag_of_openrlhf_is_accepted_or_refused_with_a_reason(tmp_path):
    flags = FIXTURE["flags"]
    assert FIXTURE["count"] == len(flags) == 14
    base = ["--serve_rm.model", str(tmp_path)]
    own = set(RewardServerConfig.model_fields)
    for opt in flags:
        name = opt["flag"][2:]
        assert name in SERVE_RM_FLAGS or name in own, f"--{name} is neither a key nor in the flag table"
        alias = SERVE_RM_FLAGS.get(name)
        if alias is not None and alias.targets == ("extra.refused",):
            with pytest.raises(ConfigError, match=rf"--{name} .*: \S+"):  # the flag and why, in one line
                parse(*base, *sample(opt))
            default = "false" if opt["action"] == "store_true" else str(opt["default"])
            parse(*base, opt["flag"], default)  # at OpenRLHF's default it changes nothing: accepted
        else:
            parse(*base, *sample(opt))


def test_openrlhf_command_lines_map_onto_the_section(tmp_path):
    cfg = parse("--reward.model_name_or_path", str(tmp_path), "--reward.normalize_enable", "--data.max_len", "8192",
                "--batch_size", "32", "--port", "5005", "--ds.param_dtype", "bf16", "--ds.packing_samples")
    assert (cfg.model, cfg.normalize, cfg.max_len, cfg.batch_size, cfg.port, cfg.dtype) == (
        str(tmp_path), True, 8192, 32, 5005, "bfloat16")
    assert cfg.host == "127.0.0.1"  # not OpenRLHF's 0.0.0.0: open to the network only when asked
    old = parse("--reward_pretrain", str(tmp_path), "--normalize_reward", "--max_len", "512", "--bf16", "--flash_attn",
                "--value_head_prefix", "score", "--host", "0.0.0.0")
    assert (old.model, old.normalize, old.max_len, old.dtype, old.host) == (str(tmp_path), True, 512, "bfloat16",
                                                                            "0.0.0.0")
    with pytest.raises(ConfigError, match="value_head_prefix value_head: the head is"):
        parse("--reward_pretrain", str(tmp_path), "--value_head_prefix", "value_head")
    with pytest.raises(ConfigError, match="serve_rm.model is empty"):
        parse("--port", "5005")


def test_help_answers_without_heavy_imports_and_run_has_the_role_contract():
    import inspect

    from actors.reward_server import run

    probe = ("import sys\nfrom launch.serve_rm import main\ncode = main(['--help'])\n"
             "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'uvicorn') if m in sys.modules))\n"
             "sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]
    assert "--serve_rm.normalize" in out.stdout and "--ds.load_in_4bit" in out.stdout
    params = inspect.signature(run).parameters
    assert list(params)[:2] == ["cfg", "stop"] and params["stop"].default is None


def test_bad_bodies_are_told_apart_from_good_ones():
    assert parse_request(b'{"query": ["ab"], "prompts": ["a"], "labels": [null]}', 4) == (["ab"], False, True)
    assert parse_request(b'{"prompts": ["a"], "completions": ["b"]}', 4) == (["ab"], True, False)
    for body, status, why in [(b"{not json", 400, "not valid JSON"), (b"[1]", 400, "JSON object"),
                              (b'{"prompts": ["a"]}', 400, "neither"), (b'{"query": "ab"}', 400, "list of strings"),
                              (b'{"query": ["a"], "completions": ["b"]}', 400, "both"),
                              (b'{"query": ["a", 3]}', 400, r"query\[1\]"),
                              (b'{"query": ["a"], "prompts": ["a", "b"]}', 400, "as long as"),
                              (b'{"query": ["a", "b", "c"]}', 413, "max_texts=2")]:
        with pytest.raises(RequestError, match=why) as e:
            parse_request(body, 2)
        assert e.value.status == status, body


# ---- real server processes -------------------------------------------------------------------------


def start(tmp: Path, name: str, *argv: str, env: dict | None = None) -> tuple[subprocess.Popen, Path, Path]:
    log, ready = tmp / f"{name}.log", tmp / f"{name}.ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve_rm", *argv], cwd=ROOT,
                            env={**subprocess_env(), READY_ENV: str(ready), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    return proc, log, ready


def wait_ready(proc: subprocess.Popen, log: Path, ready: Path, timeout: float = 90.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = read_ready(ready)
        if record is not None:
            return record["url"]
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    pytest.fail(f"no ready file within {timeout}s:\n{log.read_text()[-3000:]}")


def post(url: str, body: bytes, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method="POST"), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stats(url: str, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/stats", headers=headers), timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def rm_dirs(quick_start_files, tmp_path_factory):
    """The tiny reward model without a stored mean/std, and a copy whose config.json holds OpenRLHF's."""
    root = tmp_path_factory.mktemp("serve_rm")
    normed, plain = root / "rm_normed", root / "rm_plain"
    shutil.copytree(quick_start_files["rm"], normed)
    shutil.copytree(quick_start_files["rm"], plain)
    config = {k: v for k, v in json.loads((normed / "config.json").read_text()).items() if k not in ("mean", "std")}
    (normed / "config.json").write_text(json.dumps({**config, "mean": MEAN, "std": STD}))
    (plain / "config.json").write_text(json.dumps(config))
    return {"plain": str(plain), "normed": str(normed)}


@pytest.fixture(scope="module")
def servers(rm_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_rm_logs")
    procs = {
        "normed": start(tmp, "normed", "--reward.model_name_or_path", rm_dirs["normed"], "--reward.normalize_enable",
                        "--port", str(free_port_block(1)), "--batch_size", "8", "--serve_rm.max_wait_ms", "300",
                        "--serve_rm.max_texts", "16", "--serve_rm.max_body_bytes", "65536"),
        "guarded": start(tmp, "guarded", "--serve_rm.model", rm_dirs["plain"], "--port", "0",
                         env={"CONVEYOR_RM_TOKEN": TOKEN}),
    }
    try:
        yield {name: wait_ready(*p) for name, p in procs.items()}
        assert all(p.poll() is None for p, _, _ in procs.values()), "a server died while serving"
    finally:
        codes = {name: stop(p) for name, (p, _, _) in procs.items()}
    assert codes == {"normed": 0, "guarded": 0}  # SIGTERM: a clean exit


@pytest.fixture(scope="module")
def direct(rm_dirs):
    """Each text scored alone by the model itself: (texts, add_special_tokens) -> raw scores."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dirs["plain"]).eval()
    tok = AutoTokenizer.from_pretrained(rm_dirs["plain"])

    def score(texts: list[str], special: bool) -> list[float]:
        with torch.no_grad():
            return [model(input_ids=torch.tensor([tok.encode(t, add_special_tokens=special)])).logits[0, 0].item()
                    for t in texts]

    return score


def openrlhf_post(url: str, payloads: list[dict]) -> list[dict]:
    """The payloads sent at once the way OpenRLHF's executor sends them (aiohttp, `json=`, no headers)."""
    import aiohttp

    async def one(session, data):
        async with session.post(url, json=data) as response:
            response.raise_for_status()
            return await response.json()

    async def all_at_once():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(one(session, p) for p in payloads))

    return asyncio.run(all_at_once())


def test_openrlhf_request_gets_the_models_normalised_rewards(servers, direct):
    assert servers["normed"].startswith("http://127.0.0.1:")  # no --host: loopback only
    queries = QUERIES * 3  # 12 texts: more than one forward pass of --batch_size 8
    [answer] = openrlhf_post(servers["normed"] + "/get_reward",
                             [{"query": queries, "prompts": ["p"] * len(queries), "labels": [None] * len(queries)}])
    raw = direct(queries, special=False)  # as OpenRLHF's serve_rm tokenizes a query
    assert set(answer) == {"rewards", "scores", "extra_logs"}
    assert answer["extra_logs"]["raw_reward"] == pytest.approx(raw, abs=1e-5)
    assert answer["rewards"] == pytest.approx([(r - MEAN) / STD for r in raw], abs=1e-5)
    assert answer["scores"] == answer["rewards"]
    assert len({round(r, 6) for r in raw}) == len(QUERIES)  # the texts are told apart


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(servers, direct):
    url = servers["normed"]
    before = stats(url)
    answers = openrlhf_post(url + "/get_reward", [{"query": [q]} for q in QUERIES * 2])
    after = stats(url)
    raw = direct(QUERIES * 2, special=False)
    assert [a["extra_logs"]["raw_reward"][0] for a in answers] == pytest.approx(raw, abs=1e-5)
    assert after["requests"] - before["requests"] == 8
    assert after["batches"] - before["batches"] < 8 and after["largest_batch_requests"] >= 2, after


def test_conveyor_request_gets_the_scorers_scores(servers, direct):
    pairs = [("12+34=", "46"), ("hello", " world"), ("a", "b")]
    body = {"prompts": [p for p, _ in pairs], "completions": [c for _, c in pairs], "labels": ["46", None, None]}
    status, answer = post(servers["normed"] + "/reward", json.dumps(body).encode())
    raw = direct([p + c for p, c in pairs], special=True)  # as the scorer's `reward_model` kind tokenizes
    assert status == 200 and set(answer) == {"rewards"}
    assert answer["rewards"] == pytest.approx([(r - MEAN) / STD for r in raw], abs=1e-5)


def test_a_token_is_required_when_set(servers, direct):
    url = servers["guarded"] + "/get_reward"
    body = json.dumps({"query": QUERIES[:2]}).encode()
    assert post(url, body)[0] == 401
    assert post(url, body, token="wrong")[0] == 401
    status, answer = post(url, body, token=TOKEN)
    assert status == 200 and answer["rewards"] == pytest.approx(direct(QUERIES[:2], special=False), abs=1e-5)
    assert stats(servers["guarded"], TOKEN)["refused"] == {"401": 2}


def test_the_scorers_remote_reward_sends_the_token_and_its_reward_model_normalises_alike(servers, rm_dirs):
    from actors.rewards import RemoteReward, RewardModel
    from buffer.messages import Rollout

    rollouts = [Rollout(group_id=0, sample_index=i, lease_id=0, prompt_ids=np.array([1], np.int32),
                        completion_ids=np.array([2], np.int32), behav_logprobs=np.zeros(1, np.float32),
                        versions=np.zeros(1, np.int32), prompt=p, completion=c) for i, (p, c) in
                enumerate([("12+34=", "46"), ("hello", " world")])]
    remote = RemoteReward([servers["guarded"] + "/reward"], token=TOKEN)
    try:
        got = remote.score(rollouts)
    finally:
        remote.close()
    local = RewardModel(rm_dirs["plain"]).score(rollouts)
    assert [g.value for g in got] == pytest.approx([x.value for x in local], abs=1e-5)
    normed = RewardModel(rm_dirs["normed"], normalize=True).score(rollouts)  # scorer.reward_normalize
    assert [x.value for x in normed] == pytest.approx([(x.value - MEAN) / STD for x in local], abs=1e-5)
    with pytest.raises(ConfigError, match="scorer.reward_normalize=true but .* has no `mean` and `std`"):
        RewardModel(rm_dirs["plain"], normalize=True)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(servers):
    url = servers["normed"] + "/get_reward"
    status, answer = post(url, b'{"query": ["<s>ab"')
    assert status == 400 and "not valid JSON" in answer["error"]
    assert post(url, json.dumps({"query": ["a"] * 17}).encode())[0] == 413  # serve_rm.max_texts=16
    assert post(url, b"x" * 100_000)[0] == 413  # serve_rm.max_body_bytes=65536
    status, answer = post(url, json.dumps({"query": QUERIES[:1]}).encode())
    assert status == 200 and len(answer["rewards"]) == 1


def test_normalising_without_a_stored_mean_is_refused(rm_dirs, tmp_path):
    proc, log, _ = start(tmp_path, "no_mean", "--reward.model_name_or_path", rm_dirs["plain"],
                         "--reward.normalize_enable", "--port", "0")
    try:
        assert proc.wait(90) == 2, log.read_text()
    finally:
        stop(proc)
    assert "has no `mean` and `std`" in log.read_text()
