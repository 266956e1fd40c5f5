"""The text formats of a tool call: how a policy writes a call, and how the results come back.

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
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from actors.tools.registry import ToolCall, ToolRegistry, ToolResult


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
