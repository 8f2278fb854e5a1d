"""Tool calls on /v1/chat/completions, for any model: the tools go to the chat template, and a
`tool_choice` that asks for a call (`"required"`, or one named function) constrains the output
to JSON with a grammar (helix/runtime/grammar.py), which the server turns into OpenAI
`tool_calls`.

    named function f    the output is f's arguments: JSON following f's parameters schema
    "required"          the output is a JSON list of one or more {"name": ..., "parameters":
                        ...} (any of the tools, each with its own schema; one only with
                        parallel_tool_calls false)
    "none"              plain text (the template still sees the tools)
    "auto"              (the default with tools) the model decides, in its own call syntax:
                        the server needs the parser of it (--tool-call-parser; hermes:
                        <tool_call>{...}</tool_call> blocks, HermesCalls); without one, refused
                        naming the choices that work
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from helix.errors import RequestError


class ToolError(RequestError):
    """A tools / tool_choice / tool message field that is wrong; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]          # the functions as the chat template takes them
    mode: str                        # named | required | none | auto
    name: str | None = None          # the named function
    parallel: bool = True            # "required" may call several (parallel_tool_calls)
    parser: object = None            # auto: the model's call syntax (HermesCalls)

    @property
    def grammar(self) -> tuple[str, str] | None:
        if self.mode in ("none", "auto"):
            return None
        params = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        if self.mode == "named":
            return ("json_schema", json.dumps(params[self.name]))
        call = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for n, p in params.items()]
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not self.parallel:
            calls["maxItems"] = 1
        return ("json_schema", json.dumps(calls))

    def calls(self, text: str) -> list[dict] | None:
        """The OpenAI tool_calls of a finished output, or None when it is not a whole call
        (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            found = [(self.name, value)]
        elif isinstance(value, list):
            found = [(c.get("name"), c.get("parameters")) for c in value if isinstance(c, dict)]
        else:
            return None
        return [{"id": call_id(), "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a)}} for n, a in found]


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise ToolError(where, f"{where} must be {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": ..., \"parameters\": {{...}}}}}}")
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(where, f"{where}.function.name must be a non-empty string")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(where, f"{where}.function.parameters must be a JSON schema object")
    out = {"name": name, "parameters": params}
    if isinstance(f.get("description"), str):
        out["description"] = f["description"]
    return {"type": "function", "function": out}


def parse_tools(body: dict, parser: str | None = None) -> ToolRequest | None:
    """tools and tool_choice of a chat body -> a ToolRequest, or None without tools. parser:
    the server's --tool-call-parser (tool_choice auto needs one)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of functions")
    funcs = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["function"]["name"] for f in funcs]
    if len(set(names)) != len(names):
        raise ToolError("tools", "tools: two functions share a name")
    if choice in (None, "auto"):
        if parser == "hermes":
            return ToolRequest(funcs, "auto", parser=HermesCalls())
        raise ToolError("tool_choice", "tool_choice auto (the default with tools) needs the "
                                       "parser of this model's call syntax: start the server "
                                       "with --tool-call-parser hermes (Qwen, Hermes), or send "
                                       "tool_choice \"required\" or {\"type\": \"function\", "
                                       "\"function\": {\"name\": ...}}")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if choice in ("none", "required"):
        return ToolRequest(funcs, choice, parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", "tool_choice must be none, required or {\"type\": "
                                       "\"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the "
                                       f"tools ({', '.join(names)})")
    return ToolRequest(funcs, "named", name)


def tool_message(m: dict, i: int) -> dict:
    """The tool-call fields of a chat message, checked: an assistant's earlier tool_calls, a
    tool's result (its tool_call_id); {} for a message without them."""
    out = {}
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if m.get("role") != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise ToolError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: an "
                            f"assistant's list of {{\"function\": {{\"name\", \"arguments\"}}}}")
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"], i)}}
                             for c in calls]
    if m.get("role") == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ToolError(f"messages[{i}].tool_call_id", f"messages[{i}]: a tool message "
                                                           f"needs its tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _arguments(function: dict, i: int):
    """A past call's arguments as templates take them: the JSON object (OpenAI sends a
    string)."""
    args = function.get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            raise ToolError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: arguments "
                                                         f"must be JSON") from None
    return args


# -- tool_choice auto: the model's own call syntax ----------------------------------------------
PARSERS = ("hermes",)


class HermesCalls:
    """Hermes-style calls (Qwen 2.5 / 3, Hermes, many fine-tunes): text, then one or more
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks."""

    START, END = "<tool_call>", "</tool_call>"

    def split(self, text: str) -> tuple[str, list[dict] | None]:
        """(content before the first call, the calls) of a finished output; (text, None) when
        it holds no call or a block that is not a call (the text then goes out as it is)."""
        head, sep, rest = text.partition(self.START)
        if not sep:
            return text, None
        found = []
        for block in (self.START + rest).split(self.START)[1:]:
            body = block.split(self.END, 1)[0].strip()
            try:
                call = json.loads(body)
            except ValueError:
                return text, None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, None
            found.append(call)
        return head.rstrip(), [{"id": call_id(), "type": "function",
                                "function": {"name": c["name"],
                                             "arguments": json.dumps(c.get("arguments", {}))}}
                               for c in found]

    def safe(self, text: str) -> int:
        """How much of a streamed output's text may go out now: all of it before a call starts,
        less any tail that could be the start of one."""
        at = text.find(self.START)
        if at >= 0:
            return at
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)
