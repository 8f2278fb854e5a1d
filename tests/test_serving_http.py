"""`helix serve`'s HTTP API against the official `openai` client: one server for the module (two
CPU ranks, gloo; a tight KV pool, so concurrent requests queue and get preempted), its text
equal to transformers' greedy text, streaming equal to non-streaming, log-probabilities equal to
transformers' log-softmax (completions and chat, streamed or not; echoed prompts' too), n choices,
batches of prompts, 8 concurrent clients,
disconnects that free their pages, bad requests (400 naming the field) and overload (429) that
leave the others untouched, Prometheus metrics, KV import by file, and (last) a killed rank
reported as 503 naming it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import pytest
from hf_fixtures import hf_greedy, hf_processed_argmax
from proc_helpers import children
from serving_fixtures import checkpoint_with_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helix import Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.kv.transfer import kv_from_hf, save_kv  # noqa: E402
from helix.serving.async_engine import AsyncLLM  # noqa: E402
from helix.serving.server import HTTPServer, listen  # noqa: E402
from helix.serving.tokenizer import load_tokenizer  # noqa: E402

NAME = "tiny"
# 12 pages of 4 positions per rank (kvp 2): 96 positions in all, so 8 clients of ~20 positions
# each do not fit at once; a request of more than 96 positions never fits
RT = RuntimeConfig(page_size=4, max_context=128, max_batch=8, num_pages=12,
                   max_prefill_tokens=32)
MAX_IN_FLIGHT = 12
API_KEY = "sk-helix-test"
TEXTS = ["the cat and the dog run fast .", "red fish swim under the old bridge",
         "a small bird can sing", "the sun and the moon", "cold wind and rain",
         "old house by the sea", "blue sky over the city", "happy dog"]


class Served:
    def __init__(self, path, hf, tok, engine, server, kv_dir):
        self.path, self.hf, self.tok = path, hf, tok
        self.engine, self.server, self.kv_dir = engine, server, kv_dir
        self.url = server.url

    def client(self, cls=None):
        return (cls or openai.OpenAI)(base_url=self.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=60)

    def want(self, ids: list[int], n: int) -> str:
        """Transformers' greedy text for the prompt ids."""
        return self.tok.decode(hf_greedy(self.hf, ids, n)[0])

    def stats(self) -> dict:
        return self.server.call(self.engine.stats(), 30)


@pytest.fixture(scope="module")
def served(hf_checkpoint, tmp_path_factory):
    src, hf = hf_checkpoint("llama")
    root = tmp_path_factory.mktemp("serve")
    path = checkpoint_with_tokenizer(src, str(root / "llama-tok"))
    kv_dir = root / "kv"
    kv_dir.mkdir()
    tok = load_tokenizer(path)
    engine = AsyncLLM(path, Layout(kvp=2), RT, tok, max_in_flight=MAX_IN_FLIGHT)
    server = HTTPServer(engine, NAME, listen("127.0.0.1", 0), str(kv_dir),
                        api_key=API_KEY).start()
    yield Served(path, hf, tok, engine, server, str(kv_dir))
    server.stop()
    engine.close()


def wait_idle(served, timeout=20.0) -> dict:
    """The engine's stats once nothing runs or waits and no page is held."""
    deadline = time.time() + timeout
    while True:
        s = served.stats()
        if (s["running"], s["queued"], served.engine.in_flight) == (0, 0, 0) and \
                not any(s["kv_pages_used"]):
            return s
        assert time.time() < deadline, s
        time.sleep(0.05)


def _post(served, path: str, body: dict, key: str | None = API_KEY) -> tuple[int, dict]:
    import urllib.error
    import urllib.request
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(served.url + path, data=json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].max_model_len == 128
    import urllib.request
    with urllib.request.urlopen(served.url + "/health") as r:       # no key needed
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


@pytest.mark.parametrize("key", [None, "sk-wrong", API_KEY + "x"])
def test_the_v1_routes_need_the_api_key(served, key):
    for path, body in (("/v1/completions", {"prompt": "the cat", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": []}), ("/detokenize", {})):
        status, r = _post(served, path, body, key)
        assert status == 401 and r["error"]["code"] == "invalid_api_key"
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(served.url + "/v1/models")
    assert e.value.code == 401


def test_completion_text_equals_transformers(served):
    c = served.client()
    ids = served.tok.encode(TEXTS[0])
    want = served.want(ids, 12)
    r = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    r2 = c.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == want                                  # token ids in
    assert r2.choices[0].model_extra["token_ids"] == served.tok.encode(want)


def test_streaming_equals_non_streaming(served):
    c = served.client()
    chunks = list(c.completions.create(model=NAME, prompt=TEXTS[1], max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == served.want(served.tok.encode(TEXTS[1]), 10)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10
    msgs = [{"role": "user", "content": TEXTS[2]}]
    whole = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    parts = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=8,
                                           temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in parts)
    assert streamed == whole.choices[0].message.content == served.want(
        served.tok.chat(msgs), 8)
    assert whole.choices[0].message.role == "assistant"


def _hf_logprobs(served, prompt: list[int], out: list[int]):
    import torch
    with torch.no_grad():
        logits = served.hf(torch.tensor([prompt + out]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1)


def test_logprobs_in_completions_and_chat(served):
    c = served.client()
    ids = served.tok.encode(TEXTS[5])
    r = c.completions.create(model=NAME, prompt=TEXTS[5], max_tokens=8, temperature=0,
                             logprobs=3)
    out = r.choices[0].model_extra["token_ids"]
    lp = r.choices[0].logprobs
    want = _hf_logprobs(served, ids, out)
    assert lp.tokens == [served.tok.token_text(t) for t in out]
    assert max(abs(a - want[i, t].item()) for i, (a, t) in
               enumerate(zip(lp.token_logprobs, out))) <= 1e-3
    assert [len(d) for d in lp.top_logprobs] == [3] * 8
    assert all(next(iter(d)) == s for d, s in zip(lp.top_logprobs, lp.tokens))   # greedy
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(8)]
    chunks = [ch for ch in c.completions.create(model=NAME, prompt=TEXTS[5], max_tokens=8,
                                                 temperature=0, logprobs=3, stream=True)]
    streamed = [x for ch in chunks if ch.choices[0].logprobs
                for x in zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.text_offset))
    plain = c.completions.create(model=NAME, prompt=TEXTS[5], max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None

    msgs = [{"role": "user", "content": TEXTS[6]}]
    chat = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                     logprobs=True, top_logprobs=2)
    out = chat.choices[0].model_extra["token_ids"]
    want = _hf_logprobs(served, served.tok.chat(msgs), out)
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [served.tok.token_text(t) for t in out]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert max(abs(e.logprob - want[i, t].item())
               for i, (e, t) in enumerate(zip(content, out))) <= 1e-3
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)
    parts = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6,
                                           temperature=0, logprobs=True, stream=True))
    got = [(e.token, len(e.top_logprobs)) for p in parts if p.choices and p.choices[0].logprobs
           for e in p.choices[0].logprobs.content]
    assert got == [(e.token, 0) for e in content]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=msgs, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_tokenize_and_detokenize(served):
    status, r = _post(served, "/tokenize", {"model": NAME, "prompt": TEXTS[0]})
    assert status == 200 and r["tokens"] == served.tok.encode(TEXTS[0])
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    msgs = [{"role": "user", "content": TEXTS[1]}]
    status, r = _post(served, "/tokenize", {"messages": msgs})
    assert status == 200 and r["tokens"] == served.tok.chat(msgs)
    status, r = _post(served, "/detokenize", {"tokens": served.tok.encode(TEXTS[2])})
    assert status == 200 and r["prompt"] == served.tok.decode(served.tok.encode(TEXTS[2]))
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [1, 999]}, "tokens"),
                              ("/detokenize", {"tokens": "ab"}, "tokens")):
        status, r = _post(served, path, body)
        assert status == 400 and r["error"]["param"] == param, r
    assert _post(served, "/tokenize", {"prompt": "x"}, key=None)[0] == 401
    assert _post(served, "/tokenize", {"model": "gpt-4", "prompt": "x"})[0] == 404


def test_echo_scores_the_prompt(served):
    """lm-eval's loglikelihood requests: echo with logprobs, max_tokens 0 or 1, a batch of
    token-id prompts; the prompt's scores equal transformers' log-softmax."""
    import torch
    c = served.client()
    ids = [served.tok.encode(t) for t in TEXTS[:2]]
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=0, temperature=0, echo=True,
                             logprobs=1)
    assert r.usage.completion_tokens == 0
    for ch, p in zip(r.choices, ids):
        lp = ch.logprobs
        assert ch.text == served.tok.decode(p) and ch.model_extra["token_ids"] == []
        assert lp.tokens == [served.tok.token_text(t) for t in p]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        with torch.no_grad():
            want = torch.log_softmax(served.hf(torch.tensor([p])).logits[0, :-1].float(), -1)
        assert max(abs(a - want[i, t].item())
                   for i, (a, t) in enumerate(zip(lp.token_logprobs[1:], p[1:]))) <= 1e-3
        assert all(len(d) == 1 for d in lp.top_logprobs[1:])
    r = c.completions.create(model=NAME, prompt=TEXTS[2], max_tokens=3, temperature=0,
                             echo=True, logprobs=2)
    p, gen = served.tok.encode(TEXTS[2]), r.choices[0].model_extra["token_ids"]
    assert r.choices[0].text.startswith(TEXTS[2]) and len(gen) == 3
    assert r.choices[0].text == TEXTS[2] + served.want(p, 3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(p) + 3 and lp.token_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(p) + 3)]
    chunks = list(c.completions.create(model=NAME, prompt=TEXTS[2], max_tokens=3,
                                       temperature=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    plain = c.completions.create(model=NAME, prompt=TEXTS[2], max_tokens=3, temperature=0,
                                 echo=True)
    assert plain.choices[0].text == r.choices[0].text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                  extra_body={"echo": True})
    assert e.value.body["param"] == "echo"
    wait_idle(served)


def test_n_choices(served):
    c = served.client()
    kw = dict(model=NAME, prompt=TEXTS[4], max_tokens=6, temperature=0.9, seed=5)
    r = c.completions.create(n=3, logprobs=1, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    ids = [ch.model_extra["token_ids"] for ch in r.choices]
    assert r.usage.completion_tokens == sum(map(len, ids))
    assert r.usage.prompt_tokens == len(served.tok.encode(TEXTS[4]))
    for i, ch in enumerate(r.choices):              # choice i = the request seeded 5 + i
        one = c.completions.create(**{**kw, "seed": 5 + i}).choices[0]
        assert (ch.text, ch.model_extra["token_ids"]) == (one.text, one.model_extra["token_ids"])
        assert ch.logprobs.text_offset[0] == 0
    assert len({tuple(x) for x in ids}) > 1         # the choices differ
    chunks = list(c.completions.create(n=3, stream=True, **kw))
    for i in range(3):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert "".join(m.text for m in mine) == r.choices[i].text
        assert mine[-1].finish_reason == "length"
    msgs = [{"role": "user", "content": TEXTS[2]}]
    parts = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=5,
                                           temperature=0, n=2, stream=True))
    assert [(p.choices[0].index, p.choices[0].delta.role) for p in parts[:2]] == \
        [(0, "assistant"), (1, "assistant")]
    texts = ["".join(p.choices[0].delta.content or "" for p in parts
                     if p.choices[0].index == i) for i in range(2)]
    assert texts[0] == texts[1] == served.want(served.tok.chat(msgs), 5)   # greedy: equal
    wait_idle(served)


def test_a_batch_of_prompts(served):
    c = served.client()
    ids = served.tok.encode(TEXTS[3])
    prompts = [TEXTS[0], ids, TEXTS[1]]                # text and token ids mixed
    r = c.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    want = [served.want(served.tok.encode(TEXTS[0]), 5), served.want(ids, 5),
            served.want(served.tok.encode(TEXTS[1]), 5)]
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == [w for w in want for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(served.tok.encode(t)) for t in TEXTS[:2]) + len(ids)
    assert r.usage.completion_tokens == 30
    chunks = list(c.completions.create(model=NAME, prompt=prompts, max_tokens=5,
                                       temperature=0, stream=True))
    assert ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i)
            for i in range(3)] == want
    for bad, param in (([TEXTS[0], ""], "prompt[1]"), ([[1, 2], [1, 999]], "prompt[1]"),
                       ([TEXTS[0]] * 65, "prompt"), ([TEXTS[0]] * 7, "prompt")):
        n = 2 if len(bad) == 7 else 1                  # 14 choices: more than it holds
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=NAME, prompt=bad, max_tokens=2, n=n)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt=[ids, ids], max_tokens=2,
                             extra_body={"kv_file": "p.safetensors"})
    assert e.value.body["param"] == "kv_file"
    wait_idle(served)


def test_penalties_and_logit_bias(served):
    c = served.client()
    r = c.completions.create(model=NAME, prompt=TEXTS[7], max_tokens=4, temperature=0,
                             logit_bias={"42": 100})
    assert r.choices[0].model_extra["token_ids"] == [42] * 4
    body = dict(logit_bias={"42": 4}, frequency_penalty=1.5, presence_penalty=1)
    r = c.completions.create(model=NAME, prompt=TEXTS[7], max_tokens=8, temperature=0,
                             extra_body={"repetition_penalty": 1.5}, **body)
    ids = r.choices[0].model_extra["token_ids"]
    sp = SamplingParams(repetition_penalty=1.5, **body)
    assert ids == hf_processed_argmax(served.hf, served.tok.encode(TEXTS[7]), ids, sp)
    plain = c.completions.create(model=NAME, prompt=TEXTS[7], max_tokens=8, temperature=0)
    assert plain.choices[0].model_extra["token_ids"] != ids


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(served):
    """OpenAI's chat default: no max_tokens generates until the context (here the KV pool's
    96 positions for one request, fewer than max_context 128) is full."""
    msgs = [{"role": "user", "content": TEXTS[5]}]
    longest = served.engine.info["longest_request"]
    assert longest == 96
    r = served.client().chat.completions.create(model=NAME, messages=msgs, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == longest - len(served.tok.chat(msgs))
    with pytest.raises(openai.BadRequestError) as e:                  # more than it can hold
        served.client().chat.completions.create(model=NAME, messages=msgs,
                                                extra_body={"min_tokens": 100})
    assert e.value.body["param"] == "min_tokens"
    wait_idle(served)


def test_stop_strings_end_the_text_before_them(served):
    c = served.client()
    ids = served.tok.encode(TEXTS[0])
    full = served.want(ids, 16)
    stop = " " + full.split(" ")[3]                       # the fourth word, with its space
    want = full[:full.index(stop)]
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(c.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0,
                                       stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(served)


def test_eight_concurrent_clients(served):
    """8 clients at once, half streaming, through a pool that holds about half of them: every
    text is transformers'; afterwards no page is held."""
    async def one(c, i):
        kw = dict(model=NAME, prompt=TEXTS[i], max_tokens=12, temperature=0)
        if i % 2:
            s = await c.completions.create(stream=True, **kw)
            return "".join([ch.choices[0].text async for ch in s])
        return (await c.completions.create(**kw)).choices[0].text

    async def main():
        async with served.client(openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))
    prompts = [served.tok.encode(t) for t in TEXTS]
    pages = sum(-(-((len(p) + 12) // 2 + 1) // RT.page_size) for p in prompts)   # rank 0's
    assert pages > RT.num_pages                     # the pool cannot hold them all at once
    got = asyncio.run(main())
    assert got == [served.want(p, 12) for p in prompts]
    wait_idle(served)


def _raw_post(served, path: str, body: bytes) -> socket.socket:
    host, port = served.server.host, served.server.port
    s = socket.create_connection((host, port))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/"
              b"json\r\nauthorization: Bearer " + API_KEY.encode() + b"\r\ncontent-length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_disconnect_mid_stream_aborts_and_frees_pages(served):
    c = served.client()
    before = served.engine.metrics.requests.get("abort", 0)
    for n in (1, 2):
        s = c.completions.create(model=NAME, prompt=TEXTS[3], max_tokens=90, temperature=0,
                                 stream=True, n=n)
        for i, _ in enumerate(s):
            if i == 2:
                break
        s.close()                                    # the client goes away mid-stream
    body = json.dumps({"model": NAME, "prompt": TEXTS[4], "max_tokens": 90, "n": 2}).encode()
    raw = _raw_post(served, "/v1/completions", body)  # non-streaming, then gone
    time.sleep(0.3)
    raw.close()
    wait_idle(served, timeout=10)
    assert served.engine.metrics.requests.get("abort", 0) == before + 5   # every choice
    r = c.completions.create(model=NAME, prompt=TEXTS[3], max_tokens=6, temperature=0)
    assert r.choices[0].text == served.want(served.tok.encode(TEXTS[3]), 6)


BAD = [
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=2), 400, "top_p"),
    (dict(n=17), 400, "n"),
    (dict(n=MAX_IN_FLIGHT + 1), 400, "n"),                             # more than it holds
    (dict(logprobs=21), 400, "logprobs"),
    (dict(echo=True, max_tokens=-1), 400, "max_tokens"),
    (dict(max_tokens=0), 400, "max_tokens"),                           # 0 needs echo
    (dict(presence_penalty=3), 400, "presence_penalty"),
    (dict(extra_body={"response_format": {"type": "xml"}}), 400, "response_format"),
    (dict(extra_body={"guided_json": "{not json"}), 400, "guided_json"),
    (dict(extra_body={"min_tokens": 5}), 400, "min_tokens"),           # above max_tokens 4
    (dict(extra_body={"repetition_penalty": 0}), 400, "repetition_penalty"),
    (dict(logit_bias={"x": 1}), 400, "logit_bias"),
    (dict(logit_bias={"500": 1}), 400, "logit_bias"),                  # outside the vocabulary
    (dict(prompt=[1, 128]), 400, "prompt"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt="the cat", max_tokens=120), 400, "max_tokens"),       # never fits the pool
    (dict(prompt=list(range(5, 125)) + [3] * 10), 400, "prompt"),       # over max_context
    (dict(extra_body={"kv_file": "../../etc/passwd"}), 400, "kv_file"),
    (dict(extra_body={"kv_file": "missing.safetensors"}), 400, "kv_file"),
    (dict(extra_body={"top_k": 1.5}), 400, "top_k"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(model="gpt-4"), 404, "model"),
]


@pytest.mark.parametrize("change,status,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_request_names_the_field(served, change, status, param):
    kw = dict(model=NAME, prompt="the cat", max_tokens=4)
    kw.update(change)
    with pytest.raises(openai.APIStatusError) as e:
        served.client().completions.create(**kw)
    assert e.value.status_code == status
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"]


def test_bad_bodies_and_chat_fields(served):
    s = _raw_post(served, "/v1/chat/completions", b"{not json")
    reply = b""
    while b"}}" not in reply:
        reply += s.recv(65536)
    reply = reply.decode()
    s.close()
    assert reply.startswith("HTTP/1.1 400") and "not valid JSON" in reply
    c = served.client()
    with pytest.raises(openai.BadRequestError) as e:     # no silent tools: auto is refused
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tool_choice"
    for msgs, param in (([], "messages"), ([{"content": "x"}], "messages[0]"),
                        ([{"role": "user", "content": 5}], "messages[0].content")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=msgs)
        assert e.value.body["param"] == param


def test_overload_is_429_and_the_others_finish(served):
    """More requests at once than the server accepts: the extra ones get 429 with the reason,
    every accepted one its exact text."""
    ids = served.tok.encode(TEXTS[5])
    want = served.want(ids, 16)

    async def one(c):
        try:
            r = await c.completions.create(model=NAME, prompt=TEXTS[5], max_tokens=16,
                                           temperature=0)
            return r.choices[0].text
        except openai.RateLimitError as e:
            return e

    async def main():
        async with served.client(openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(one(c) for _ in range(MAX_IN_FLIGHT + 6)))
    got = asyncio.run(main())
    rejected = 'helix_requests_rejected_total{reason="overloaded"}'
    before = int(metrics(served)[1].get(rejected, 0))
    got = asyncio.run(main())
    refused = [g for g in got if isinstance(g, Exception)]
    assert refused and all("limit" in g.body["message"] for g in refused)
    assert [g for g in got if not isinstance(g, Exception)] == [want] * (len(got) - len(refused))
    wait_idle(served)
    assert int(metrics(served)[1][rejected]) == before + len(refused)


def metrics(served) -> tuple[str, dict]:
    """GET /metrics -> (its text, {series: value}); asserts the Prometheus text content type."""
    import urllib.request
    with urllib.request.urlopen(served.url + "/metrics") as r:
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return text, dict(line.rsplit(" ", 1) for line in text.splitlines()
                      if not line.startswith("#"))


def test_metrics_are_prometheus_text(served):
    """The series after this test's own 8 requests (the module's other tests may run on
    another worker, or not at all)."""
    c = served.client()
    for i in range(8):
        c.completions.create(model=NAME, prompt=TEXTS[i % len(TEXTS)], max_tokens=2,
                             temperature=0)
    wait_idle(served)
    text, samples = metrics(served)
    assert samples["helix_up"] == "1"
    assert samples['helix_kv_pages_used{rank="1"}'] == "0"
    assert samples['helix_kv_pages_free{rank="0"}'] == "12"
    assert int(samples["helix_time_to_first_token_seconds_count"]) >= 8
    assert int(samples['helix_requests_total{finish_reason="length"}']) >= 8
    # the engine loop's time between busy steps: some, and far below the steps' own
    loop, steps = (float(samples[f"helix_engine_{k}_seconds_total"]) for k in ("loop", "step"))
    assert 0 < loop < steps
    for line in text.splitlines():
        assert line.startswith("# ") or len(line.rsplit(" ", 1)) == 2, line


def test_usage_counts_prompt_tokens_read_from_the_prefix_cache(served):
    """The same prompt again: its whole 8-position blocks (2 ranks x 4-position pages) but the
    last prompt token's come from the cache, reported as OpenAI's cached_tokens, streamed and
    not; the text is transformers'. The metrics count the hits."""
    ids = list(range(3, 33))                       # 30 tokens no other test sends
    c = served.client()
    first = c.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 24
    assert again.choices[0].text == first.choices[0].text == served.want(ids, 4)
    chunks = list(c.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 24
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == first.choices[0].text
    wait_idle(served)                                # fresh engine stats
    _, samples = metrics(served)
    assert int(samples["helix_prefix_cache_hits_total"]) >= 48
    assert int(samples["helix_prefix_cache_queries_total"]) >= 90
    assert "helix_preemptions_total" in samples     # (its count: test_runtime_api)
    # dropped (with the key only): the pool is all free, and the prompt is prefilled again
    assert _post(served, "/reset_prefix_cache", {}, key=None)[0] == 401
    assert _post(served, "/reset_prefix_cache", {}) == (200, {"kv_pages_free": [12, 12]})
    after = c.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.choices[0].text == first.choices[0].text


def test_structured_outputs(served):
    """guided_choice and guided_regex over the word tokenizer's pieces (which join without
    spaces: "catdog" is the tokens cat, dog; the text puts spaces between words); a schema that
    does not compile is a 400 naming it, and the server goes on."""
    import re
    c = served.client()
    r = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=8, temperature=0,
                             extra_body={"guided_choice": ["catdog", "bird"]})
    assert r.choices[0].text in ("cat dog", "bird") and r.choices[0].finish_reason == "stop"
    for seed in range(3):
        chat = c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": TEXTS[1]}], max_tokens=8,
            temperature=1.0, seed=seed, extra_body={"guided_regex": "(red|blue)(fish|bird)"})
        assert re.fullmatch("(red|blue) (fish|bird)", chat.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        c.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "a"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": 5}}})
    with pytest.raises(openai.BadRequestError, match="give one structured output"):
        c.completions.create(model=NAME, prompt="a", max_tokens=4,
                             extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert c.completions.create(model=NAME, prompt=TEXTS[2], max_tokens=2).choices[0].text


def test_kv_import_by_file(served):
    """A prefill server's KV (here transformers' cache) in a file under --kv-dir: the same
    text as prefilling the prompt."""
    import torch
    ids = served.tok.encode(TEXTS[6])
    with torch.no_grad():
        cache = served.hf(torch.tensor([ids]), use_cache=True).past_key_values
    save_kv(kv_from_hf(cache), os.path.join(served.kv_dir, "p.safetensors"))
    r = served.client().completions.create(model=NAME, prompt=ids, max_tokens=10,
                                           temperature=0, extra_body={"kv_file": "p.safetensors"})
    assert r.choices[0].text == served.want(ids, 10)


def _worker_ranks(pid: int) -> list[int]:
    """The engine's worker processes: its descendants without children of their own (spawned
    directly, or forked by a fork server), resource trackers aside."""
    out, todo = [], list(children(pid))
    while todo:
        p = todo.pop()
        kids = children(p)
        with open(f"/proc/{p}/cmdline", "rb") as f:
            tracker = b"resource_tracker" in f.read()
        if kids:
            todo += kids
        elif not tracker:
            out.append(p)
    return out


def test_killed_rank_is_503_naming_it(served):
    """Last: rank 1 is killed. /health says so within the engine's liveness interval, and a
    request gets 503 naming the rank; the server process lives on."""
    (worker,) = _worker_ranks(served.engine._proc.pid)
    os.kill(worker, signal.SIGKILL)
    t0 = time.time()
    c = served.client()
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=NAME, prompt=TEXTS[7], max_tokens=30, temperature=0)
    assert e.value.status_code == 503 and "rank 1" in e.value.body["message"]
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(served.url + "/health")
    assert h.value.code == 503 and "rank 1" in json.loads(h.value.read())["error"]["message"]
    assert time.time() - t0 < 15
