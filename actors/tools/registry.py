"""Tools a policy can call in an episode, and the registry that runs them.

A turn with tools, as the episode loop drives it:

    calls = fmt.parse(completion_text)                 # list[ToolCall]; [] when the turn calls nothing
    results = await registry.run_all(calls)            # concurrently, in the calls' order
    observation = fmt.render(results)                  # the text the environment appends (its tokens
                                                       # are context, masked out of the loss)

Nothing here raises for what a model writes or a tool does: a malformed call (bad JSON, an unknown
tool, bad arguments, an unclosed tag) or a tool that raises, hangs or crashes becomes a `ToolResult`
whose text starts with "error: " and says what went wrong (`ok` False), and the episode goes on; a
flood of output is cut to its first 64 KiB and says how much was dropped.

The text formats of a call are actors/tools/formats.py's. \
Tools: `Calculator` (actors/tools/calculator.py: exact arithmetic through `ast`, never eval) and
`PythonTool` (actors/tools/sandbox.py); any other is a `Tool` subclass with an `async call(arguments) -> str`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

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
