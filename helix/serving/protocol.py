"""The OpenAI request bodies of /v1/completions and /v1/chat/completions -> (prompt ids,
SamplingParams, stream options), every field checked: a bad one raises FieldError naming it
(HTTP 400). `stop` strings end the text before them. Log-probabilities: `logprobs` (an
integer, alternatives per token) on /v1/completions, `logprobs: true` and `top_logprobs` on
/v1/chat/completions (helix/runtime/logprobs.py); `echo` on /v1/completions puts the prompt
(and with logprobs its tokens' scores, position 0 none) before each choice, and allows
max_tokens 0 (the prompt scored, nothing generated). Penalties: presence_penalty,
frequency_penalty, logit_bias (helix/runtime/penalties.py). Extensions (as vLLM's): top_k,
repetition_penalty, min_tokens, stop_token_ids, ignore_eos, kv_file (a KV import,
helix/kv/transfer.py, under the server's --kv-dir). Structured outputs: response_format,
guided_json / _regex / _choice / _grammar, structured_outputs (helix/runtime/grammar.py); chat
tools with tool_choice required or a named function (helix/serving/tools.py). Every choice also
carries its "token_ids".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from helix.errors import RequestError
from helix.runtime.grammar import choice_spec
from helix.runtime.logprobs import MAX_LOGPROBS
from helix.runtime.sampling import SEED_LIMIT, SamplingParams
from helix.serving.tools import ToolError, ToolRequest, parse_tools, tool_message


class FieldError(RequestError):
    """A request field that is wrong; `param` names it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class Parsed:
    prompts: list[list[int]]         # one, or a completions batch
    params: SamplingParams
    stream: bool
    include_usage: bool
    kv: str | None = None            # a KV import file
    stop: tuple[str, ...] = ()       # stop strings
    n: int = 1                       # choices per prompt
    echo: list[str] | None = None    # completions' echo: each prompt's text, put before its
                                     # choices' text (and its scores before their logprobs)
    score_only: bool = False         # echo with max_tokens 0: the prompt scored, no tokens
    to_context: bool = False         # chat without a max_tokens: generate until the end of
                                     # the context (choices' longest_request)
    tools: ToolRequest | None = None  # chat's tools and tool_choice (helix/serving/tools.py)

    def choices(self, longest_request: int) -> list[tuple[list[int], SamplingParams]]:
        """(prompt ids, params) of each choice, prompt by prompt, n each (one engine request
        a choice); a seeded request's i-th choice draws with seed + i. longest_request: the
        positions one request can hold (to_context's limit). Raises RequestError when the
        params cannot be (min_tokens over that limit)."""
        out = []
        for ids in self.prompts:
            p = self.params
            if self.to_context:
                try:
                    p = replace(p, max_new_tokens=max(1, longest_request - len(ids)))
                except RequestError as e:               # min_tokens past the context left
                    raise _named(e, "max_completion_tokens") from None
            out += [(ids, p if p.seed is None else replace(p, seed=(p.seed + i) % SEED_LIMIT))
                    for i in range(self.n)]
        return out


# fields a client may send that Helix does not implement: refused unless left at the default
# (the legacy functions would change what is generated: never silently ignored)
UNSUPPORTED = {"suffix": (None, ""), "best_of": (None, 1), "functions": (None, []),
               "function_call": (None, "none"), "prediction": (None,),
               "audio": (None,), "modalities": (None, ["text"])}
# structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
MAX_STOPS = 4
MAX_N = 16                     # choices per prompt
MAX_PROMPTS = 64               # prompts in a completions batch
TO_CONTEXT = 2**31 - 1         # a chat's max tokens until Parsed.choices knows the context left


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise FieldError(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FieldError(name, f"{name} must be {bound}, got {v}")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FieldError(name, f"{name} must be a finite number, got {v!r}")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise FieldError(name, f"{name} must be true or false, got {v!r}")
    return v


def token_ids_field(value, name: str, vocab: int) -> list[int]:
    """A request field of token ids, each checked against the vocabulary."""
    if not isinstance(value, list) or not value:
        raise FieldError(name, f"{name} must be a non-empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise FieldError(name, f"{name} must hold integers, got {t!r}")
        if not 0 <= t < vocab:
            raise FieldError(name, f"{name}: token id {t} is outside the vocabulary [0, {vocab})")
    return value


def _check_unsupported(body: dict) -> None:
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise FieldError(name, f"{name} is not supported by this server: leave it out")


def _logit_bias(body: dict) -> dict:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise FieldError("logit_bias", "logit_bias must be an object of token id -> bias, e.g. "
                                       "{\"50256\": -100}")
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token the request asks for, None for no log-probabilities: completions'
    integer `logprobs`; chat's `logprobs: true` with `top_logprobs` alternatives."""
    if not chat:
        return _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top is not None:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


def _schema_text(name: str, schema) -> str:
    """A JSON schema given as an object or as JSON text -> its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise FieldError(name, f"{name}: the schema is not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise FieldError(name, f"{name}: a JSON schema is an object")
    return json.dumps(schema)


def _guided(name: str, kind: str, value) -> tuple[str, str]:
    """One structured-output request (vLLM's kinds: json, regex, choice, grammar) -> a spec."""
    if kind == "json":
        return ("json_schema", _schema_text(name, value))
    if kind == "choice":
        try:
            return choice_spec(value)
        except RequestError as e:
            raise FieldError(name, f"{name}: {e}") from None
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"{name} must be a non-empty string")
    return ("regex" if kind == "regex" else "ebnf", value)


def _grammar(body: dict) -> tuple[str, str] | None:
    """The request's grammar (helix/runtime/grammar.py), from at most one of response_format
    (json_object, json_schema), guided_json / _regex / _choice / _grammar, structured_outputs."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("json", ""))
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise FieldError("response_format", "response_format json_schema needs "
                                 "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            found.append(("json_schema", _schema_text("response_format", inner["schema"])))
        elif kind != "text":
            raise FieldError("response_format", "response_format type must be text, "
                                                "json_object or json_schema")
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(_guided(name, kind, body[name]))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise FieldError("structured_outputs", "structured_outputs must be an object, e.g. "
                                                   "{\"regex\": \"(yes|no)\"}")
        for kind in ("json", "regex", "choice", "grammar"):
            if so.get(kind) is not None:
                found.append(_guided("structured_outputs", kind, so[kind]))
    if len(found) > 1:
        raise FieldError("response_format", "give one structured output (response_format, a "
                                            "guided_* field or structured_outputs), not several")
    return found[0] if found else None


def sampling(body: dict, vocab: int, max_tokens_field: str = "max_tokens",
             chat: bool = False, echo: bool = False) -> SamplingParams:
    """The sampling fields -> SamplingParams (OpenAI defaults: temperature 1, max_tokens 16 on
    completions; chat without one: TO_CONTEXT, which Parsed.choices replaces by the context
    left). echo: the prompt's scores come too (prompt_logprobs = logprobs), and max_tokens may
    be 0 (one token is generated and dropped)."""
    max_tokens = _int(body, max_tokens_field, None, 0 if echo else 1)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _int(body, "max_tokens", None, 1)
    logprobs = _logprobs(body, chat)
    top_k = _int(body, "top_k", 0, -1)
    stop_ids = body.get("stop_token_ids") or []
    try:
        return SamplingParams(
            max_new_tokens=(max(1, max_tokens) if max_tokens is not None else
                            TO_CONTEXT if chat else 16),
            temperature=_num(body, "temperature", 1.0),
            top_p=_num(body, "top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,
            seed=_int(body, "seed", None, 0, 2**63 - 1),
            stop_token_ids=(tuple(token_ids_field(stop_ids, "stop_token_ids", vocab))
                            if stop_ids else ()),
            ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            presence_penalty=_num(body, "presence_penalty", 0.0),
            frequency_penalty=_num(body, "frequency_penalty", 0.0),
            repetition_penalty=_num(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body), min_tokens=_int(body, "min_tokens", 0, 0),
            priority=_int(body, "priority", 0, -2**31, 2**31 - 1),
            grammar=_grammar(body))
    except FieldError:
        raise
    except RequestError as e:
        raise _named(e, max_tokens_field) from None


def _named(e: RequestError, max_tokens_field: str) -> FieldError:
    """SamplingParams' own check as a FieldError: its message names its field first."""
    field = str(e).split(" ", 1)[0]
    name = {"max_new_tokens": max_tokens_field}.get(field, field)
    return FieldError(name, str(e).replace("max_new_tokens", max_tokens_field))


def _stop(body: dict, tokenizer) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None or stop == [] or stop == "":
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOPS:
        raise FieldError("stop", f"stop must be a non-empty string or a list of at most "
                                 f"{MAX_STOPS} of them")
    if tokenizer is None:
        raise FieldError("stop", "stop strings need a tokenizer and this model has none (a "
                                 "preset): use stop_token_ids")
    return tuple(stops)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise FieldError("stream_options", "stream_options must be an object")
    return stream, _bool(opts, "include_usage") if stream else False


def _kv_file(body: dict, kv_dir: str | None) -> str | None:
    path = body.get("kv_file")
    if path is None:
        return None
    if kv_dir is None:
        raise FieldError("kv_file", "kv_file: this server takes no KV imports: start it with "
                                    "--kv-dir DIR")
    if not isinstance(path, str):
        raise FieldError("kv_file", f"kv_file must be a path, got {path!r}")
    root = os.path.realpath(kv_dir)
    full = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise FieldError("kv_file", f"kv_file must lie under the server's --kv-dir {kv_dir}")
    return full


def _prompt(prompt, tokenizer, vocab: int, name: str) -> list[int]:
    """One prompt (text, or a list of token ids) -> ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise FieldError(name, f"{name} is empty: give some text or token ids")
        if tokenizer is None:
            raise FieldError(name, f"{name}: this model has no tokenizer (a preset): send the "
                                   f"prompt as a list of token ids")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise FieldError(name, f"{name} encodes to no tokens: give some text")
        return ids
    return token_ids_field(prompt, name, vocab)


def parse_completion(body, tokenizer, vocab: int, kv_dir: str | None = None) -> Parsed:
    """A /v1/completions body (prompt: text, a list of token ids, or a list of either: a batch,
    whose choices come prompt by prompt)."""
    body = _object(body)
    _check_unsupported(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise FieldError("prompt", "prompt is required: a string or a list of token ids")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise FieldError("prompt", f"prompt: a batch of {len(prompt)} prompts is more than "
                                       f"{MAX_PROMPTS}: send fewer per request")
        prompts = [_prompt(p, tokenizer, vocab, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_prompt(prompt, tokenizer, vocab, "prompt")]
    kv = _kv_file(body, kv_dir)
    if kv is not None and len(prompts) > 1:
        raise FieldError("kv_file", "kv_file: a KV import is one prompt's: send one prompt")
    echo = _bool(body, "echo")
    if echo and kv is not None:
        raise FieldError("echo", "echo scores the prompt, which a KV import does not prefill: "
                                 "leave out echo or kv_file")
    stream, usage = _stream(body)
    texts = None
    if echo:
        given = prompt if len(prompts) > 1 else [prompt]
        texts = [t if isinstance(t, str) else tokenizer.decode(ids) if tokenizer else ""
                 for t, ids in zip(given, prompts)]
    return Parsed(prompts, sampling(body, vocab, echo=echo), stream, usage, kv,
                  _stop(body, tokenizer), _int(body, "n", 1, 1, MAX_N), texts,
                  echo and body.get("max_tokens") == 0)


def _text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):                 # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise FieldError(f"messages[{i}].content", f"messages[{i}].content: only text "
                                                           f"parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise FieldError(f"messages[{i}].content", f"messages[{i}].content must be a string")


def parse_chat(body, tokenizer, vocab: int, kv_dir: str | None = None,
               tool_parser: str | None = None) -> Parsed:
    """A /v1/chat/completions body, rendered through the checkpoint's chat template;
    tool_parser: the server's --tool-call-parser (helix/serving/tools.py)."""
    body = _object(body)
    _check_unsupported(body)
    if body.get("echo") not in (None, False):
        raise FieldError("echo", "echo is not supported by chat completions: leave it out")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty list of {role, content}")
    rendered = []
    try:
        tools = parse_tools(body, tool_parser)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise FieldError(f"messages[{i}]", f"messages[{i}] must be an object with a "
                                                   f"role and content")
            calls = tool_message(m, i)
            content = "" if m.get("content") is None and calls else _text(m.get("content"), i)
            rendered.append({"role": m["role"], "content": content, **calls})
    except ToolError as e:
        raise FieldError(e.param, str(e)) from None
    if tokenizer is None:
        raise FieldError("messages", "messages: this model has no tokenizer (a preset): use "
                                     "/v1/completions with token ids")
    try:
        ids = tokenizer.chat(rendered, list(tools.tools) if tools else None)
    except RequestError as e:
        raise FieldError("messages", str(e)) from None
    stream, usage = _stream(body)
    params = sampling(body, vocab, "max_completion_tokens", chat=True)
    if tools is not None and tools.grammar is not None:
        if params.grammar is not None:
            raise FieldError("tool_choice", "a tool call is JSON of its own: leave out "
                                            "response_format / guided_* with this tool_choice")
        params = replace(params, grammar=tools.grammar)
    return Parsed([ids], params, stream, usage, _kv_file(body, kv_dir), _stop(body, tokenizer),
                  _int(body, "n", 1, 1, MAX_N), to_context=params.max_new_tokens == TO_CONTEXT,
                  tools=tools)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise FieldError(None, "the request body must be a JSON object")
    return body
