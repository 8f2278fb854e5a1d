"""Tool calls on /v1/chat/completions (helix/serving/tools.py) through the `openai` client: a
named function or tool_choice "required" constrain the output to the call's JSON, returned as
`tool_calls` (streamed: a named function's arguments as they come) with finish reason
"tool_calls"; the arguments are the tokens of the same grammar run straight on an LLM
(transformers' argmax over the allowed ids is checked for grammars in tests/test_grammar.py);
"auto" with the server's hermes parser finds the model's own <tool_call> blocks (the random
model is steered into that syntax by a guided_regex); malformed tools are refused naming the
field. The server runs the tiny Llama with the character-level
tokenizer (tests/serving_fixtures.py)."""

from __future__ import annotations

import json

import pytest
from serving_fixtures import checkpoint_with_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.serving.async_engine import AsyncLLM  # noqa: E402
from helix.serving.server import HTTPServer, listen  # noqa: E402
from helix.serving.tokenizer import load_tokenizer  # noqa: E402
from helix.serving.tools import ToolError, ToolRequest, parse_tools, tool_message  # noqa: E402

NAME = "tiny-tools"
RT = RuntimeConfig(page_size=4, max_context=256, max_batch=4)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(hf_checkpoint, tmp_path_factory):
    src, _ = hf_checkpoint("llama")
    path = checkpoint_with_tokenizer(src, str(tmp_path_factory.mktemp("tools") / "char"),
                                     chars=True)
    tok = load_tokenizer(path)
    engine = AsyncLLM(path, Layout(), RT, tok, max_in_flight=8)
    server = HTTPServer(engine, NAME, listen("127.0.0.1", 0), None,
                        tool_parser="hermes").start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    yield path, tok, client
    server.stop()
    engine.close()


def direct(path: str, tok, grammar, tools=None) -> str:
    """The text the same prompt and grammar give straight through an LLM (greedy)."""
    ids = tok.chat(MESSAGES, tools)
    with LLM(path, Layout(), RT) as llm:
        rid = llm.add_request(ids, SamplingParams(max_new_tokens=200, grammar=grammar))
        while llm.has_unfinished():
            llm.step()
        assert llm.finish_reasons[rid] == "stop"
        return tok.decode(llm.outputs[rid])


def test_a_named_function_is_called_with_its_schemas_arguments(served):
    path, tok, c = served
    choice = {"type": "function", "function": {"name": "weather"}}
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                  temperature=0, max_tokens=200)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")
    assert args == json.loads(direct(path, tok, ("json_schema", json.dumps(WEATHER)), TOOLS))
    # streamed: the role, then the arguments as they come, the first fragment naming the call
    chunks = list(c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                            tool_choice=choice, temperature=0, max_tokens=200,
                                            stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    fragments = [d.tool_calls[0] for d in deltas[1:]]
    assert len(fragments) > 2 and all(f.index == 0 for f in fragments)
    assert fragments[0].function.name == "weather" and fragments[0].id.startswith("call_")
    assert all(f.id is None and f.function.name is None for f in fragments[1:])
    assert json.loads("".join(f.function.arguments for f in fragments)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not d.content for d in deltas)                     # no JSON text leaks


def test_required_calls_any_of_the_tools(served):
    """One call (parallel_tool_calls false); with parallel calls allowed this random model
    keeps listing calls until max_tokens cuts it: then the text comes back as content."""
    path, tok, c = served
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                  tool_choice="required", parallel_tool_calls=False,
                                  temperature=0, max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    schema = {"weather": WEATHER, "time": TIME}
    args = json.loads(call.function.arguments)
    assert set(args) == set(schema[call.function.name]["required"])
    text = direct(path, tok, ToolRequest(tuple(TOOLS), "required", parallel=False).grammar,
                  TOOLS)
    assert json.loads(text) == [{"name": call.function.name, "parameters": args}]
    cut = c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                    tool_choice="required", temperature=0, max_tokens=30)
    if cut.choices[0].finish_reason == "length":
        assert cut.choices[0].message.tool_calls is None
        assert cut.choices[0].message.content.startswith("[{")


def test_tool_results_in_the_history_and_none(served):
    _, _, c = served
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    r = c.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="none",
                                  temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)


HERMES = (r'Sure<tool_call>\{"name": "time", "arguments": \{"zone": "(UTC|CET)"\}\}'
          r'</tool_call>')


def test_auto_finds_the_models_own_calls(served):
    """tool_choice auto (the default with tools) on a server with --tool-call-parser hermes:
    the text before the first <tool_call> is the content, the blocks are the calls; streamed,
    the content goes out as it comes and no part of a call leaks into it. Text without a call
    stays text."""
    _, tok, c = served
    steer = {"guided_regex": HERMES}
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                                  max_tokens=200, extra_body=steer)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Sure"
    (call,) = msg.tool_calls
    assert call.function.name == "time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                            temperature=0, max_tokens=200, stream=True,
                                            extra_body=steer))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == "Sure" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads(chunks[-1].choices[0].delta.tool_calls[0].function.arguments) == \
        json.loads(call.function.arguments)
    plain = c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS,
                                      temperature=0, max_tokens=50,
                                      extra_body={"guided_regex": "(hi|bye) <b>"})
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content in ("hi <b>", "bye <b>")
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}],
      "tool_choice": "required"}, "tools[0]"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"guided_regex": "a"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": 1},
     "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_requests_name_the_field(served, body, param):
    _, _, c = served
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, **{"messages": MESSAGES, "max_tokens": 4, **body})
    assert e.value.body["param"] == param, e.value.body


def test_tool_request_units():
    for choice in (None, "auto"):                   # no parser: auto refused, naming the fixes
        with pytest.raises(ToolError, match="--tool-call-parser hermes") as e:
            parse_tools({"tools": TOOLS, "tool_choice": choice})
        assert e.value.param == "tool_choice"
    hermes = parse_tools({"tools": TOOLS}, "hermes").parser
    assert hermes.safe("ab<tool") == 2 and hermes.safe("ab<tool_call>{") == 2
    assert hermes.safe("a < b") == 5
    content, calls = hermes.split('ok <tool_call>{"name": "f", "arguments": {"x": 1}}'
                                  '</tool_call>\n<tool_call>{"name": "g"}</tool_call>')
    assert content == "ok" and [(x["function"]["name"], x["function"]["arguments"])
                                for x in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert hermes.split("no call") == ("no call", None)
    assert hermes.split("<tool_call>{broken") == ("<tool_call>{broken", None)
    req = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function",
                                                       "function": {"name": "time"}}})
    assert req.mode == "named" and req.grammar == ("json_schema", json.dumps(TIME))
    assert req.calls('{"zone": "UTC"}')[0]["function"] == {"name": "time",
                                                           "arguments": '{"zone": "UTC"}'}
    assert req.calls('{"zone": "U') is None                     # cut by max_tokens
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}).grammar is None
    req = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    calls = req.calls('[{"name": "time", "parameters": {"zone": "CET"}}]')
    assert [c["function"]["name"] for c in calls] == ["time"] and req.calls("{}") is None
    assert tool_message({"role": "user", "content": "x"}, 0) == {}
    with pytest.raises(ToolError, match="arguments must be JSON"):
        tool_message({"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{"}}]}, 2)
    with pytest.raises(ToolError, match="an assistant's list"):
        tool_message({"role": "user", "tool_calls": []}, 1)
