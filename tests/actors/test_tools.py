"""Tools: the calculator's values and refusals, the Python sandbox's limits (real subprocesses), the
two call formats, the registry."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import tracemalloc

import pytest

from actors.tools.calculator import Calculator
from actors.tools.formats import HermesFormat, TagFormat, make_format, template_turn, tool_messages
from actors.tools.registry import Tool, ToolCall, ToolRegistry, ToolResult
from actors.tools.sandbox import PythonTool, SandboxLimits

FAST = SandboxLimits(timeout_s=2.0, memory_mb=256)


def run(coro):
    return asyncio.run(coro)


def python(code: str, limits: SandboxLimits = FAST) -> ToolResult:
    return run(PythonTool(limits).invoke({"code": code}))


def gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, value", [
    ("2+3*4", "14"),
    ("(2 + 3) * 4 / 5", "4"),           # 20/5
    ("0.1 + 0.2", "0.3"),               # exact: 1/10 + 2/10, not the float 0.30000000000000004
    ("10 / 4", "2.5"),
    ("7 / 20", "0.35"),                 # 20 = 2^2 * 5: two places, exact
    ("1 / 3", "0.333333333333"),        # not a finite decimal: 12 places
    ("2 / 3", "0.666666666667"),        # rounded, last place 6 -> 7
    ("-7 // 2", "-4"),                  # floor, as Python: -3.5 -> -4
    ("-7 % 3", "2"),                    # -7 = 3 * -3 + 2
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("-(1 - 3)", "2"),
    ("1_000 * 2", "2000"),
    ("3.50", "3.5"),
    ("1 ** 10 ** 100", "1"),            # a huge exponent of 1 is fine
    ("12345678901234567890 * 98765432109876543210", "1219326311370217952237463801111263526900"),
    ("2+3=", "5"),                      # a trailing "=" is forgiven
])
def test_calculator_values(expression, value):
    assert Calculator().evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("1 / 0", "division by zero"),
    ("10 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "exponent must be an integer"),
    ("2 ^ 3", "write **"),
    ("9 ** 9 ** 9", "power too large"),      # refused before computing it
    ("2 ** 4096", "power too large"),        # 4097 bits > 4096
    ("2 ** 4000", "digits"),                 # 1205 digits > 1000
    ("(2 ** 4000) * (2 ** 4000)", "bits"),   # each fits, the product does not
    ("__import__('os').system('true')", "unsupported"),
    ("x + 1", "unsupported"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 501, "longer than 500"),
])
def test_calculator_refusals(expression, why):
    text = Calculator().evaluate(expression)
    assert text.startswith("error: calculator: ") and why in text, text


# ---------------------------------------------------------------- python sandbox


def test_python_prints_result_in_a_clean_throwaway_process(monkeypatch):
    monkeypatch.setenv("CONVEYOR_TEST_SECRET", "hunter2")
    r = python("import os\nprint(sum(range(10)))\nprint(os.getcwd())\nprint(sorted(os.environ))")
    total, cwd, env = r.text.splitlines()
    assert r.ok and total == "45" and r.info["network"] == "isolated"
    assert "CONVEYOR_TEST_SECRET" not in env and "HOME" in env
    assert not os.path.exists(cwd)  # the working directory went with the call


def test_python_hang_is_killed_with_its_process_group():
    code = ("import os, subprocess, time\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            "print(os.getpid(), child.pid, flush=True)\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    r = python(code, SandboxLimits(timeout_s=1.5, memory_mb=256))
    assert time.monotonic() - start < 3.5
    head, _, pids = r.text.partition("\noutput so far:\n")
    assert not r.ok and r.info["timed_out"] and head == "error: python timed out after 1.5 s"
    assert len(pids.split()) == 2, r.text
    deadline = time.monotonic() + 2.0
    while not all(gone(int(p)) for p in pids.split()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(int(p)) for p in pids.split()), pids  # the program and the `sleep` it started


def test_python_cancelled_call_leaves_nothing_behind(tmp_path):
    # The registry's bound (0.5 s) is shorter than the sandbox's (5 s): the call is cancelled mid-run.
    registry = ToolRegistry([PythonTool(SandboxLimits(timeout_s=5.0, memory_mb=256))], timeout_s=0.5)
    code = ("import os, time\n"
            f"open({str(tmp_path / 'where')!r}, 'w').write(f'{{os.getpid()}} {{os.getcwd()}}')\n"
            "time.sleep(60)\n")
    r = run(registry.run(ToolCall("python", {"code": code})))
    assert r.text == "error: python timed out after 0.5 s"
    pid, cwd = (tmp_path / "where").read_text().split()
    deadline = time.monotonic() + 2.0
    while not gone(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(int(pid)) and not os.path.exists(cwd)


def test_python_crash_reports_the_traceback_tail():
    # 100 KB of stderr first: only the last 8 KiB are kept, and the exception is at their end.
    code = ("import sys\nsys.stderr.write('noise ' * 17000 + '\\n')\n"
            "def parse(s):\n    raise ValueError(f'bad input {s}')\nparse(42)\n")
    r = python(code)
    assert not r.ok and r.info["returncode"] == 1
    assert r.text.startswith("error: python exited with status 1\n")
    assert r.text.endswith("ValueError: bad input 42") and 'File "main.py", line 4, in parse' in r.text
    assert len(r.text) < 8 * 1024 + 100


def test_python_flood_is_capped_without_holding_it():
    tracemalloc.start()
    try:
        r = python("print('x' * 10_000_000)")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.ok and r.info["output_dropped"] == 10_000_001 - 64 * 1024  # the newline too
    assert r.text == "x" * (64 * 1024) + f"\n[output truncated: {10_000_001 - 64 * 1024} more bytes dropped]"
    assert peak < 2_000_000, peak  # a few 64 KiB chunks, never the 10 MB


def test_python_allocation_past_the_memory_limit_fails():
    r = python("block = bytearray(512 << 20)\nprint('allocated')")  # 512 MiB under a 256 MiB limit
    assert not r.ok and "allocated" not in r.text and r.text.endswith("MemoryError"), r.text


def test_python_has_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = python("import socket\ntry:\n"
                   f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('connected')\n"
                   "except OSError as e:\n    print('refused:', e)\n")
        assert r.ok and r.text.startswith("refused: [Errno 101] Network is unreachable"), r.text
        assert r.info["network"] == "isolated"
        with pytest.raises(BlockingIOError):  # nothing reached our loopback
            listener.accept()
    finally:
        listener.close()


def test_python_calls_run_concurrently():
    async def main():
        tool = PythonTool(SandboxLimits(timeout_s=5.0, memory_mb=256))
        return await asyncio.gather(*(tool.invoke({"code": f"import time\ntime.sleep(1.0)\nprint({i})"})
                                      for i in range(4)))

    start = time.monotonic()
    results = run(main())
    elapsed = time.monotonic() - start
    assert [r.text for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert elapsed < 2.5, elapsed  # one after another would take over 4 s


# ---------------------------------------------------------------- formats and registry


class Echo(Tool):
    name, description = "echo", "Repeat a text n times."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
                  "required": ["text"], "additionalProperties": False}

    async def call(self, arguments):
        return arguments["text"] * arguments.get("n", 1)


class Broken(Tool):
    name = "broken"
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}

    async def call(self, arguments):
        if arguments.get("q") == "hang":
            await asyncio.sleep(60)
        raise KeyError("oops")


def test_registry_tools_list_and_failures():
    registry = ToolRegistry([Calculator(), Echo(), Broken()], timeout_s=0.2)
    assert registry.schemas()[0] == {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly, e.g. (2 + 3) * 4 / 5 or 2 ** 10.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string", "description": "the expression"}},
                       "required": ["expression"], "additionalProperties": False}}}
    assert [s["function"]["name"] for s in registry.schemas()] == ["calculator", "echo", "broken"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Echo())

    calls = [ToolCall("echo", {"text": "ab", "n": 2}), ToolCall("nope", {}), ToolCall("echo", {"n": 2}),
             ToolCall("echo", {"text": "a", "n": "2"}), ToolCall("echo", {"text": "a", "m": 1}),
             ToolCall("broken", {}), ToolCall("broken", {"q": "hang"}), ToolCall("", error="unclosed <x>")]
    texts = [r.text for r in run(registry.run_all(calls))]
    assert texts == [
        "abab",
        "error: unknown tool 'nope'; tools are ['broken', 'calculator', 'echo']",
        "error: echo: missing argument(s) ['text']",
        "error: echo: argument 'n' must be of type integer, got \"2\"",
        "error: echo: unknown argument(s) ['m']; expected ['n', 'text']",
        "error: broken raised KeyError: 'oops'",
        "error: broken timed out after 0.2 s",
        "error: unclosed <x>",
    ]


def test_hermes_parse_and_render():
    fmt = make_format("hermes", ToolRegistry())
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>'
            '<tool_call>["calculator"]</tool_call> and <tool_call>{"name": "python"')
    calls = fmt.parse(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "2+3"}),
                                                          ("python", {"code": "print(1)"})]
    assert [c.error.split(" (")[0].split(":")[0] for c in calls[2:]] == [
        "tool call is not valid JSON", 'tool call must be {"name"', "unclosed <tool_call>"]
    assert fmt.parse("no call here") == []
    results = run(ToolRegistry([Calculator()]).run_all(calls[:1]))
    assert fmt.render(results + [ToolResult("x", "error: y", False)]) == (
        "<tool_response>\n5\n</tool_response>\n<tool_response>\nerror: y\n</tool_response>")
    assert tool_messages(results) == [{"role": "tool", "name": "calculator", "content": "5"}]


def test_tags_parse_and_render():
    registry = ToolRegistry([Calculator(), PythonTool()])
    fmt = make_format("tags", registry)
    assert isinstance(fmt, TagFormat) and fmt.stop == ["</calc>", "</python>"]
    calls = fmt.parse("so 3<5 and <b> then <calc>2+3*4</calc><result>9</result> <calc>1/0</calc> <foo>x</foo> <calc>7")
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3*4"}, None),
        ("calculator", {"expression": "1/0"}, None),
        ("foo", {}, "unknown tool <foo>; tools are ['calc', 'python']"),
        ("calculator", {}, "unclosed <calc>: no </calc> after it"),
    ]
    assert fmt.render(run(registry.run_all(calls))) == (
        "<result>14</result><result>error: calculator: division by zero</result>"
        "<result>error: unknown tool <foo>; tools are ['calc', 'python']</result>"
        "<result>error: unclosed <calc>: no </calc> after it</result>")
    assert fmt.parse("nothing to do") == [] and isinstance(make_format("hermes", registry), HermesFormat)
    with pytest.raises(ValueError, match="exactly one string argument"):
        TagFormat(ToolRegistry([Echo()]))
    with pytest.raises(ValueError, match="'hermes' or 'tags'"):
        make_format("xml", registry)


# A Hermes-style template (Qwen's shape): tools listed in a system turn, tool results in a user turn.
# Newlines go inside {{ }}: transformers renders with trim_blocks, which drops one after a {% %} tag.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_template_turn_renders_only_the_appended_text():
    from demo.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    registry = ToolRegistry([Calculator()])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=registry.schemas(),
                                           tokenize=False, add_generation_prompt=True)
    assert '{"type": "function", "function": {"name": "calculator"' in prompt
    results = [ToolResult("calculator", "5", True), ToolResult("calculator", "7", True)]
    assert template_turn(tokenizer, tool_messages(results), tools=registry.schemas()) == (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
