"""Tools a policy can call in an episode, the registry that runs them, and the text formats of a call.

A turn with tools, as the episode loop drives it:

    calls = fmt.parse(completion_text)                 # list[ToolCall]; [] when the turn calls nothing
    results = await registry.run_all(calls)            # concurrently, in the calls' order
    observation = fmt.render(results)                  # the text the environment appends (its tokens
                                                       # are context, masked out of the loss)

Nothing here raises for what a model writes or a tool does: a malformed call (bad JSON, an unknown
tool, bad arguments, an unclosed tag) or a tool that raises, hangs or crashes becomes a `ToolResult`
whose text starts with "error: " and says what went wrong (`ok` False), and the episode goes on; a
flood of output is cut to its first 64 KiB and says how much was dropped.

Formats (`make_format(name, registry)`):

- "hermes" (Qwen/Hermes JSON, what chat templates with `tools=` expect): the model writes
  `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>` (one or more per
  turn) and gets `<tool_response>`, 5, `</tool_response>` on lines of their own. Where the
  tokenizer has a chat template that takes `tools=`, pass it `registry.schemas()` for the prompt
  and let it render the results: `template_turn(tokenizer, tool_messages(results))` is the text it
  appends after an assistant turn.
- "tags", plain enough for a character-level tiny tokenizer: `<calc>2+3*4</calc>` -> `<result>14</result>`;
  in general `<TAG>ARG</TAG>` for any tool that takes one string argument (`Tool.tag`, by default its
  name). Text in angle brackets that is no tool's tag and has no closing tag is prose, not a call.

`fmt.stop` lists the strings at which generation should pause (`SamplingParams(stop=...,
include_stop_str_in_output=True)`), so the result comes right after the call.

Tools: `Calculator` (exact arithmetic through `ast`, never eval) and `PythonTool` (the sandbox of
`actors/sandbox.py`); any other is a `Tool` subclass with an `async call(arguments) -> str`.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Sequence

from actors.sandbox import SandboxLimits, run_python

ERROR = "error: "  # every error observation starts so: a model can learn it, a metric can count it


@dataclass
class ToolCall:
    """One call parsed from a model's text; `error` set when the text was not a well-formed call."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ToolResult:
    """What a call gave: `text` is the observation; `info` holds figures for logs (time, limits hit)."""

    name: str
    text: str
    ok: bool
    info: dict[str, Any] = field(default_factory=dict)


class Tool:
    """A tool: `name`, `description` and `parameters` (a JSON schema of the arguments object) are
    what the model is shown; `call` does the work and returns the observation text.

    `call` should not raise (return "error: ..." instead); if it does, the registry turns the
    exception into an error observation. A tool that knows more than text (time taken, a limit hit)
    overrides `invoke` to return a `ToolResult` with `info`.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    tag: str | None = None
    """The tag of the "tags" format, for a tool of one string argument; None: the tool's name."""

    async def call(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    async def invoke(self, arguments: dict[str, Any]) -> ToolResult:
        text = await self.call(arguments)
        return ToolResult(self.name, text, ok=not text.startswith(ERROR))

    def schema(self) -> dict[str, Any]:
        """The entry of a chat template's `tools=` list (OpenAI/Hermes function style)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def check_arguments(schema: dict[str, Any], arguments: Any) -> str | None:
    """Why `arguments` do not fit the object `schema` (required keys, unknown keys where
    `additionalProperties` is false, top-level types), or None. Enough for tool arguments; not a
    full JSON-schema validator."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {missing}"
    if schema.get("additionalProperties", True) is False:
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    for key, value in arguments.items():
        want = props.get(key, {}).get("type")
        if want in types and (not isinstance(value, types[want]) or (want != "boolean" and isinstance(value, bool))):
            return f"argument {key!r} must be of type {want}, got {json.dumps(value)[:80]}"
    return None


class ToolRegistry:
    """The tools of an episode by name: `schemas()` for the prompt, `run(call)` for a parsed call.

    `timeout_s` bounds every call (None: no bound), a backstop for tools without limits of their
    own; the Python sandbox has its own, shorter ones. One registry serves many episodes at once.
    """

    def __init__(self, tools: Iterable[Tool] = (), timeout_s: float | None = 30.0):
        self.timeout_s = timeout_s
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        if not tool.name or tool.name in self._tools:
            raise ValueError(f"tool name {tool.name!r} is empty or already registered ({sorted(self._tools)})")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __iter__(self):
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The `tools=` list a chat template (or an OpenAI request) takes."""
        return [tool.schema() for tool in self]

    async def run(self, call: ToolCall) -> ToolResult:
        """Run one parsed call; every failure is an error observation."""
        if call.error is not None:
            return ToolResult(call.name, ERROR + call.error, ok=False)
        tool = self._tools.get(call.name)
        if tool is None:
            known = sorted(self._tools)
            return ToolResult(call.name, f"{ERROR}unknown tool {call.name!r}; tools are {known}", ok=False)
        why = check_arguments(tool.parameters, call.arguments)
        if why is not None:
            return ToolResult(call.name, f"{ERROR}{call.name}: {why}", ok=False)
        try:
            return await asyncio.wait_for(tool.invoke(call.arguments), self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(call.name, f"{ERROR}{call.name} timed out after {self.timeout_s:.1f} s", ok=False)
        except Exception as e:  # a tool's bug is the episode's observation, never the generator's crash
            return ToolResult(call.name, f"{ERROR}{call.name} raised {type(e).__name__}: {e}", ok=False)

    async def run_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """All calls of a turn at once; results in the calls' order."""
        return list(await asyncio.gather(*(self.run(c) for c in calls)))


# ---------------------------------------------------------------- formats


class HermesFormat:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> `<tool_response>...</tool_response>`."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self):
        self.stop: list[str] = []  # the calls come before the end of the turn: generation stops at EOS

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._parse_one(m.group(1)) for m in self._CALL.finditer(text)]
        if "<tool_call>" in self._CALL.sub("", text):
            calls.append(ToolCall("", error="unclosed <tool_call>: no </tool_call> after it"))
        return calls

    @staticmethod
    def _parse_one(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", error=f"tool call is not valid JSON ({e}): {body.strip()[:200]}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            shape = '{"name": ..., "arguments": {...}}'
            return ToolCall("", error=f"tool call must be {shape}, got {body.strip()[:200]}")
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return ToolCall(obj["name"], error=f"{obj['name']}: arguments are not valid JSON ({e})")
        return ToolCall(obj["name"], args)

    def render(self, results: Sequence[ToolResult]) -> str:
        return "\n".join(f"<tool_response>\n{r.text}\n</tool_response>" for r in results)


class TagFormat:
    """`<TAG>ARG</TAG>` -> `<result>...</result>`, for tools of one string argument."""

    name = "tags"
    RESULT = "result"
    _OPEN = re.compile(r"<([a-z_][a-z0-9_]*)>")

    def __init__(self, registry: ToolRegistry):
        self._by_tag: dict[str, tuple[str, str]] = {}  # tag -> (tool name, its argument's key)
        for tool in registry:
            props = tool.parameters.get("properties", {})
            tag = tool.tag or tool.name
            if len(props) != 1 or next(iter(props.values())).get("type") != "string":
                raise ValueError(f"tool {tool.name!r} needs exactly one string argument for the tags format, "
                                 f"has parameters {tool.parameters}")
            if not self._OPEN.fullmatch(f"<{tag}>") or tag == self.RESULT or tag in self._by_tag:
                raise ValueError(f"tool {tool.name!r}: tag {tag!r} must be a new lowercase identifier, "
                                 f"not {self.RESULT!r}")
            self._by_tag[tag] = (tool.name, next(iter(props)))
        self.stop = [f"</{tag}>" for tag in self._by_tag]

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while m := self._OPEN.search(text, pos):
            tag, pos = m.group(1), m.end()
            if tag == self.RESULT:
                continue
            close = text.find(f"</{tag}>", pos)
            if close < 0:
                if tag in self._by_tag:
                    calls.append(ToolCall(self._by_tag[tag][0], error=f"unclosed <{tag}>: no </{tag}> after it"))
                continue  # an unknown unclosed tag is prose ("<b" or "a<b>c")
            arg, pos = text[pos:close], close + len(tag) + 3
            if tag not in self._by_tag:
                calls.append(ToolCall(tag, error=f"unknown tool <{tag}>; tools are {sorted(self._by_tag)}"))
            else:
                name, key = self._by_tag[tag]
                calls.append(ToolCall(name, {key: arg}))
        return calls

    def render(self, results: Sequence[ToolResult]) -> str:
        return "".join(f"<{self.RESULT}>{r.text}</{self.RESULT}>" for r in results)


def make_format(name: str, registry: ToolRegistry) -> HermesFormat | TagFormat:
    if name == "hermes":
        return HermesFormat()
    if name == "tags":
        return TagFormat(registry)
    raise ValueError(f"tool format must be 'hermes' or 'tags', got {name!r}")


def tool_messages(results: Sequence[ToolResult]) -> list[dict[str, str]]:
    """The results as chat messages of role `tool`, for a chat template to render."""
    return [{"role": "tool", "name": r.name, "content": r.text} for r in results]


def template_turn(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> str:
    """The text a chat template appends for `messages` (tool results) after an assistant turn, up to
    and including the next assistant turn's opening (the generation prompt).

    Rendered as the difference between a short conversation with and without `messages`, so only
    the appended text is tokenised and the ids so far are never re-encoded. It starts where the
    template's rendering of the assistant turn ends, which may be after text the model did not
    generate: Qwen's template ends a turn with `<|im_end|>` and a newline, so a model that stopped
    at its `<|im_end|>` token still lacks the newline, which the caller appends before this text.
    """
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]
    before = tokenizer.apply_chat_template(base, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once tool messages follow; "
                         "it cannot be extended turn by turn")
    return after[len(before):]


# ---------------------------------------------------------------- calculator


class Calculator(Tool):
    """Exact arithmetic: + - * / // % ** and parentheses on integers and decimals (as fractions, so
    0.1 + 0.2 is 0.3). Results print as integers, exact decimals, or decimals rounded to `places`."""

    name = "calculator"
    tag = "calc"
    description = "Evaluate an arithmetic expression exactly, e.g. (2 + 3) * 4 / 5 or 2 ** 10."
    parameters = {"type": "object", "properties": {"expression": {"type": "string", "description": "the expression"}},
                  "required": ["expression"], "additionalProperties": False}

    def __init__(self, max_chars: int = 500, max_bits: int = 4096, max_digits: int = 1000, places: int = 12):
        self.max_chars, self.max_bits, self.max_digits, self.places = max_chars, max_bits, max_digits, places

    _BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}

    async def call(self, arguments: dict[str, Any]) -> str:
        return self.evaluate(arguments["expression"])

    def evaluate(self, expression: str) -> str:
        """The value of `expression` as text, or "error: calculator: ..."."""
        text = expression.strip().rstrip("=").strip()
        try:
            if len(text) > self.max_chars:
                raise ValueError(f"expression longer than {self.max_chars} characters")
            tree = ast.parse(text, mode="eval")
            return self._format(self._eval(tree.body, text))
        except SyntaxError:
            return f"{ERROR}calculator: not an arithmetic expression: {text[:100]!r}"
        except ZeroDivisionError:
            return f"{ERROR}calculator: division by zero"
        except (ValueError, RecursionError, MemoryError) as e:
            return f"{ERROR}calculator: {e or type(e).__name__}"

    def _eval(self, node: ast.AST, text: str) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.Constant) and type(node.value) is float:
            return Fraction(ast.get_source_segment(text, node))  # the literal as written: "0.1" is 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = self._eval(node.operand, text)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and (type(node.op) in self._BINARY or isinstance(node.op, ast.Pow)):
            left, right = self._eval(node.left, text), self._eval(node.right, text)
            if isinstance(node.op, ast.Pow):
                value = self._power(left, right)
            else:  # Fraction // Fraction is an int
                value = Fraction(self._BINARY[type(node.op)](left, right))
            if max(value.numerator.bit_length(), value.denominator.bit_length()) > self.max_bits:
                raise ValueError(f"intermediate result over {self.max_bits} bits")
            return value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ValueError("'^' is not a power here: write ** (2 ** 3)")
        raise ValueError(f"unsupported: {ast.get_source_segment(text, node)!r} "
                         "(only numbers, + - * / // % ** and parentheses)")

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ValueError(f"exponent must be an integer, got {self._format(exponent)}")
        if base in (0, 1, -1):
            return base ** exponent.numerator
        # A lower bound on the result's size (within a factor 2), checked before computing it.
        bits = abs(exponent.numerator) * (max(base.numerator.bit_length(), base.denominator.bit_length()) - 1) + 1
        if bits > self.max_bits:
            raise ValueError(f"power too large (about {bits} bits; the limit is {self.max_bits})")
        return base ** exponent.numerator

    def _format(self, value: Fraction) -> str:
        if value.denominator == 1:
            text = str(value.numerator)
        else:
            den, twos, fives = value.denominator, 0, 0
            while den % 2 == 0:
                den, twos = den // 2, twos + 1
            while den % 5 == 0:
                den, fives = den // 5, fives + 1
            # Exact in max(twos, fives) places when the denominator is 2^a 5^b; otherwise rounded.
            places = max(twos, fives) if den == 1 else self.places
            scaled = round(value * 10 ** places)  # half-even
            sign, digits = "-" if scaled < 0 else "", str(abs(scaled)).rjust(places + 1, "0")
            text = f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
            text = "0" if text == "-0" else text
        if len(text) > self.max_digits:
            raise ValueError(f"result has {len(text)} digits (the limit is {self.max_digits})")
        return text


# ---------------------------------------------------------------- python


class PythonTool(Tool):
    """Run a Python program in the sandbox of `actors/sandbox.py`; its output is the observation."""

    name = "python"
    description = ("Run a Python 3 program and return what it prints (stdout, then stderr). "
                   "No network; limited time, memory and output.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"], "additionalProperties": False}

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits

    async def call(self, arguments: dict[str, Any]) -> str:
        return (await self.invoke(arguments)).text

    async def invoke(self, arguments: dict[str, Any]) -> ToolResult:
        r = await run_python(arguments["code"], self.limits)
        info = {"elapsed_s": r.elapsed_s, "returncode": r.returncode, "timed_out": r.timed_out,
                "output_dropped": r.stdout_dropped, "network": r.network}
        return ToolResult(self.name, r.observation(self.limits), ok=r.ok, info=info)
