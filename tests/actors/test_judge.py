"""The LLM judge (actors/judge.py): its template checks and grade parsing by hand; its retries,
failures and counters against a scripted chat server of the test's own; and, end to end, against
the project's OpenAI-compatible endpoint (actors/agents/openai_server.py) on a real vLLM engine
serving the tiny model, whose junk answers must fail their samples, counted, never raise."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actors.judge import DEFAULT_TEMPLATE, JudgeReward, check_template, parse_score, quote
from launch.ports import free_port_block
from tests.helpers.scoring import make_rollout

# ---- pure: templates and grades ------------------------------------------------------------------


def test_the_default_template_asks_for_the_prompt_and_response():
    assert check_template(DEFAULT_TEMPLATE) == {"prompt", "response"}
    assert check_template("Q {prompt}\nReference {label}\nA {response}\n{{not a field}}") == \
        {"prompt", "label", "response"}


@pytest.mark.parametrize("template, why", [
    ("Q {prompt} A {answer}", r"unknown placeholder\(s\) \{answer\}"),
    ("{response} {} {0} {prompt.upper}", r"unknown placeholder\(s\) \{\}, \{0\}, \{prompt.upper\}"),
    ("{response:{width}}", r"unknown placeholder\(s\) \{width\}"),
    ("Q {prompt} and no completion", r"has no \{response\} placeholder"),
    ("{response} {", "not a format string"),
    ("{response:d}", "cannot be filled in"),
])
def test_a_bad_template_is_refused_naming_what_is_wrong(template, why):
    with pytest.raises(ValueError, match="scorer.judge_template: " + why):
        check_template(template)
    with pytest.raises(ValueError, match=why):
        JudgeReward("http://127.0.0.1:1/v1", model="m", template=template)


@pytest.mark.parametrize("text, max_score, want", [
    ("Reasoning...\nScore: 7", 10, 7.0),
    ("score: 7.", 10, 7.0),
    ("**Score:** 8", 10, 8.0),
    ("Final score = 4", 10, 4.0),
    ("Score:10", 10, 10.0),
    ("Score: 0", 10, 0.0),
    ("Score: 7.5", 10, 7.5),
    ("Score: 7/10", 10, 7.0),
    ("Score: 3\n... on reflection\nScore: 9", 10, 9.0),  # the last one counts
    ("Good answer, 8 / 10.", 10, 8.0),  # N/max ending the answer
    ("Score: 4", 5, 4.0),
    # no grade: None
    ("no idea", 10, None),
    ("", 10, None),
    ("Score: N", 10, None),  # the rubric's own line echoed
    ("Score: 9\nScore: N/A", 10, None),  # the last `Score:` holds no number
    ("Score: 11", 10, None),  # outside [0, max_score]
    ("Score: -1", 10, None),
    ("Score: 7.5x", 10, None),
    ("Score: 1e3", 10, None),
    ("Score: 4/5", 10, None),  # another scale than the rubric's
    ("7/10 of the steps are right, the rest wrong", 10, None),  # N/10 not at the end
    ("12/10", 10, None),
    ("The answer is 7", 10, None),  # a bare number is not a grade
    (None, 10, None),
])
def test_parse_score(text, max_score, want):
    assert parse_score(text, max_score) == want


# ---- a scripted chat server: retries, failures, counters ----------------------------------------


class _ChatServer:
    """An OpenAI-style chat endpoint whose answer depends on the response text it is asked to grade
    (the template is `{response}` alone, so the message is that text):

        seven  -> "Score: 7"                    unsure -> "no idea" (every time)
        flaky  -> 500, then "Score: 3"          bad    -> 400
        hang   -> no answer until released      shape  -> 200 with a body that is no chat completion

    The first request of each of the first `together` samples waits until all of them have come
    (a sample that came alone gets 503), so a judge that sends them one at a time fails."""

    def __init__(self, models=("judge-m",), together: int = 0):
        self.requests: Counter = Counter()  # by response text
        self.bodies: list[dict] = []
        self.auth: set[str] = set()
        self.models_asked = 0
        self.release = threading.Event()
        barrier = threading.Barrier(together, timeout=30) if together else None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _answer(self, text: str) -> None:
                self._send(200, {"object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})

            def do_GET(self):
                server.models_asked += 1
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                what = body["messages"][0]["content"]
                server.bodies.append(body)
                server.auth.add(self.headers.get("Authorization", ""))
                server.requests[what] += 1
                k = server.requests[what]
                if barrier is not None and k == 1:
                    try:
                        barrier.wait()
                    except threading.BrokenBarrierError:
                        return self._send(503, {"error": "this request came alone"})
                if what == "seven":
                    self._answer("The response is mostly right.\nScore: 7")
                elif what == "unsure":
                    self._answer("no idea")
                elif what == "flaky":
                    self._send(500, {"error": "busy"}) if k == 1 else self._answer("Score: 3")
                elif what == "bad":
                    self._send(400, {"error": {"message": "max_tokens too large"}})
                elif what == "hang":
                    server.release.wait(30)
                    self._answer("Score: 1")
                else:
                    self._send(200, "<html>a proxy's error page</html>")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _rollouts(*completions: str, label: str | None = "7"):
    return [make_rollout("Grade me", c, label, group_id=i) for i, c in enumerate(completions)]


def test_the_judge_grades_retries_and_fails_samples_with_the_reason():
    server = _ChatServer(together=4)
    judge = JudgeReward(server.url, template="{response}", retries=3, backoff_s=0.01, concurrency=4,
                        max_tokens=32, temperature=0.5, token="sekrit")
    try:
        out = judge.score(_rollouts("seven", "unsure", "flaky", "bad"))
        again = judge.score(_rollouts("seven"))
    finally:
        judge.close()
        server.close()
    # a grade over max_score; "no idea" 3 times (malformed, retried); 500 then a grade; 400 at once
    assert [s.value for s in out] == [0.7, None, 0.3, None], [s.error for s in out]
    assert [s.extra for s in out] == [{"judge/malformed": m, "judge/attempts": a}
                                      for m, a in ((0.0, 1.0), (1.0, 3.0), (0.0, 2.0), (0.0, 1.0))]
    assert out[1].error == (f"judge {server.url} failed after 3 attempt(s): answered without a score in [0, 10]: "
                            "'no idea'")
    assert out[3].error.startswith(f"judge {server.url} failed after 1 attempt(s): HTTP 400") \
        and "max_tokens too large" in out[3].error
    assert again[0].value == 0.7
    assert server.requests == {"seven": 2, "unsure": 3, "flaky": 2, "bad": 1}
    assert (judge.calls, judge.failures, judge.malformed) == (8, 2, 3)
    # the model the endpoint lists, asked once; the request as configured, with the bearer token
    assert judge.model == "judge-m" and server.models_asked == 1 and server.auth == {"Bearer sekrit"}
    assert server.bodies[0] == {"model": "judge-m", "messages": [{"role": "user", "content": server.bodies[0][
        "messages"][0]["content"]}], "max_tokens": 32, "temperature": 0.5}


def test_what_the_endpoint_does_fails_samples_never_the_caller():
    """A body that is no chat completion, a judge that hangs past timeout_s, one that is not there,
    one that lists no model, a {label} the sample lacks: failed samples, each with its reason."""
    server = _ChatServer()
    judge = JudgeReward(server.url, model="m", template="{response}", timeout_s=0.3, retries=2, backoff_s=0.01)
    try:
        t0 = time.monotonic()
        shape, hang = judge.score(_rollouts("shape", "hang"))
        elapsed = time.monotonic() - t0
    finally:
        judge.close()
    assert shape.value is None and "answered without a chat completion: \"<html>a proxy's error page</html>\"" \
        in shape.error and shape.extra == {"judge/malformed": 1.0, "judge/attempts": 2.0}
    assert hang.value is None and hang.error.endswith("failed after 2 attempt(s): no answer within 0.3s")
    assert elapsed < 5.0  # about retries x timeout_s, not the 30 s the server would take
    assert (judge.calls, judge.failures, judge.malformed) == (4, 2, 2)

    empty = _ChatServer(models=())
    judge = JudgeReward(empty.url, template="{response}")
    try:
        out = judge.score(_rollouts("seven", "seven"))
    finally:
        judge.close()
        empty.close()
        server.close()
    assert [s.error for s in out] == [f"judge {empty.url}/models lists no model; set scorer.judge_model"] * 2
    assert judge.failures == 2 and judge.calls == 0 and empty.requests == {}

    port = free_port_block(1)  # nothing listens there
    judge = JudgeReward(f"http://127.0.0.1:{port}/v1", model="m", template="{response} {label}", retries=2,
                        backoff_s=0.01)
    try:
        gone, unlabelled = judge.score(_rollouts("a") + _rollouts("b", label=None))
    finally:
        judge.close()
    assert "failed after 2 attempt(s): unreachable" in gone.error
    assert unlabelled.error == "the judge's template asks for {label} but the sample has none"
    assert judge.calls == 2 and judge.failures == 2


def test_a_long_malformed_answer_is_quoted_by_its_end():
    text = "x" * 500 + " I cannot decide"
    assert quote(text) == repr("..." + text[-160:]) and len(quote(text)) < 170
    assert quote("no idea") == "'no idea'"


# ---- live: the project's OpenAI-compatible endpoint on a vLLM engine ----------------------------

LIVE_TEMPLATE = "Rate 0-10.\nQ: {prompt}\nA: {response}\nEnd with Score: N\n"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from actors.engines import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), dtype="float32", seed=0)
    yield engine
    engine.close()


def _judge_agent(base_url: str, row, rollouts, results):
    """Judge one rollout through this session's endpoint: even rows by the session's base_url, odd
    ones by the plain /v1 path with the session id as the bearer token. One request (retries=1): a
    session is one conversation, so asking the same question again would not extend it."""
    root, _, rest = base_url.partition("/s/")
    url, token = (f"{root}/v1", rest.split("/")[0]) if row.index % 2 else (base_url, "")
    judge = JudgeReward(url, template=LIVE_TEMPLATE, retries=1, max_tokens=8, token=token)
    try:
        got = judge.score([rollouts[row.index]])[0]
        results[row.index] = (got, judge.calls, judge.failures, judge.malformed, judge.model,
                              judge.render(rollouts[row.index]))
    finally:
        judge.close()
    return 0.0 if got.value is None else got.value


@pytest.mark.slow
def test_a_live_judge_on_the_tiny_model_fails_its_junk_answers_counted(vllm_engine, tiny_model_dir):
    """Four sessions at once, each a JudgeReward asking the real endpoint (the model by GET /models,
    the rubric as one user message, greedy sampling on vLLM): the tiny model's answers hold no grade,
    so each sample fails quoting the judge's words, `malformed` counts each answer, nothing raises."""
    from transformers import AutoTokenizer

    from actors.agents.openai_server import AgentServer
    from actors.config import GeneratorConfig
    from actors.engines.base import Sampling
    from buffer.messages import PromptGroup

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # the engine's, with a chat template (its own has none)
    tok.chat_template = CHAT_TEMPLATE
    rollouts = [make_rollout(f"{i}+{i}=", str(2 * i + (i % 2)), str(2 * i), group_id=i) for i in range(4)]
    groups = [PromptGroup(i, r.prompt, r.label, index=i) for i, r in enumerate(rollouts)]
    cfg = GeneratorConfig(model=str(tiny_model_dir), max_new_tokens=8, max_turns=1, session_timeout_s=120.0)
    results: dict = {}
    server = AgentServer(_judge_agent, {"rollouts": rollouts, "results": results}, tokenizer=tok)
    try:
        counts = Counter()
        played = server.play(groups, 1, vllm_engine, Sampling(temperature=0.0, max_tokens=8), cfg,
                             lambda contexts, turn: [c[0] for c in vllm_engine.generate(contexts, 1, turn)], counts)
    finally:
        server.close()
    assert counts["sessions_completed"] == 4 and counts["sessions_failed"] == 0, counts
    assert sorted(results) == [0, 1, 2, 3]
    for i, (got, calls, failures, malformed, model, rubric) in results.items():
        (episode,) = played[i]
        # the request reached the engine as the rubric in one user message, under the listed model
        assert model == "policy"
        assert episode.prompt_ids == list(tok.apply_chat_template([{"role": "user", "content": rubric}],
                                                                  add_generation_prompt=True, return_dict=False))
        assert 1 <= sum(episode.mask) <= 8
        answer = tok.decode(episode.ids, skip_special_tokens=True)
        assert parse_score(answer) is None, answer  # (greedy: the same junk every run)
        assert got.value is None and got.error.startswith("judge http://127.0.0.1:"), got.error
        assert got.error.endswith(f"failed after 1 attempt(s): answered without a score in [0, 10]: {quote(answer)}")
        assert got.extra == {"judge/malformed": 1.0, "judge/attempts": 1.0}
        assert (calls, failures, malformed) == (1, 1, 1)
