"""Structured outputs (helix/runtime/grammar.py): a request's tokens constrained by a regular
expression, a choice of strings, a JSON schema or an EBNF grammar.

The oracle: transformers' logits of the tiny Llama, masked by an independent xgrammar matcher
(its own compile of the same language, its bitmask read bit by bit here): at each step the
argmax over the allowed ids, until the matcher has accepted a stop token. The checkpoint carries
a character-level tokenizer (tests/serving_fixtures.py), so JSON and regexes work as they do over
real tokenizers' pieces.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from hf_fixtures import SMALL, VOCAB, hf_greedy
from serving_fixtures import checkpoint_with_tokenizer

xgr = pytest.importorskip("xgrammar")

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.errors import RequestError  # noqa: E402
from helix.runtime.grammar import allowed, bitmask, choice_spec  # noqa: E402
from helix.serving.protocol import FieldError, _grammar  # noqa: E402
from helix.serving.tokenizer import load_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}},
          "required": ["color", "age"], "additionalProperties": False}
EBNF = 'root ::= "the " animal (" and " animal)?\nanimal ::= "cat" | "dog"'
# (Helix spec, the oracle's compile of the same language)
SPECS = {
    "regex": (("regex", "(yes|no)!"), lambda c: c.compile_regex("(yes|no)!")),
    "choice": (choice_spec(["red", "blue sky"]), lambda c: c.compile_regex("(red|blue sky)")),
    "json_schema": (("json_schema", json.dumps(SCHEMA)),
                    lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
    "ebnf": (("ebnf", EBNF), lambda c: c.compile_grammar(EBNF)),
}


@pytest.fixture(scope="module")
def char_ckpt(hf_checkpoint, tmp_path_factory):
    """The tiny Llama with the character-level tokenizer -> (path, HF model, tokenizer)."""
    src, hf = hf_checkpoint("llama")
    path = checkpoint_with_tokenizer(src, str(tmp_path_factory.mktemp("grammar") / "char"),
                                     chars=True)
    return path, hf, load_tokenizer(path)


@torch.no_grad()
def oracle(hf, path: str, prompt: list[int], compile_fn, n: int) -> list[int]:
    from transformers import AutoTokenizer
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(path),
                                              vocab_size=VOCAB)
    m = xgr.GrammarMatcher(compile_fn(xgr.GrammarCompiler(info)))
    mask, out = xgr.allocate_token_bitmask(1, VOCAB), []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + out]), use_cache=False).logits[0, -1].float()
        m.fill_next_token_bitmask(mask, 0)
        ok = torch.tensor([bool((int(mask[0, i // 32]) >> (i % 32)) & 1) for i in range(VOCAB)])
        out.append(int(logits.masked_fill(~ok, -torch.inf).argmax()))
        assert m.accept_token(out[-1])
        if m.is_terminated():
            break
    return out


def _llm(path: str, layout: Layout | None = None, **runtime) -> LLM:
    return LLM(path, layout or Layout(), RuntimeConfig(**{**SMALL, **runtime}))


def _run(llm: LLM, prompt: list[int], specs: list, n: int = 40, **kw) -> list[int]:
    ids = [llm.add_request(prompt, SamplingParams(max_new_tokens=n, grammar=s, **kw))
           for s in specs]
    while llm.has_unfinished():
        llm.step()
    return ids


def test_a_bitmask_word_w_bit_j_is_id_32w_plus_j():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int64, generator=g).to(torch.int32)
    got = allowed(words, 100)
    want = torch.tensor([[bool((int(words[r, i // 32]) >> (i % 32)) & 1) for i in range(100)]
                         for r in range(3)])
    assert torch.equal(got, want)
    assert allowed(bitmask(2, 70), 70).all()


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_tokens_are_the_argmax_over_the_grammars_ids(char_ckpt, overlap):
    """Four grammars and an unconstrained request in one batch: each constrained request's
    tokens are the oracle's and end when its language is complete (finish "stop"), its text is
    a sentence of the language; the unconstrained request's are transformers' own. With overlap
    on, the steps that hold a constrained row wait for the step before."""
    path, hf, tok = char_ckpt
    prompt = tok.encode("the cat")
    with _llm(path, overlap=overlap) as llm:
        free = llm.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        ids = _run(llm, prompt, [spec for spec, _ in SPECS.values()])
        got = {k: llm.outputs[i] for k, i in zip(SPECS, ids)}
        assert all(llm.finish_reasons[i] == "stop" for i in ids)
        assert llm.outputs[free] == hf_greedy(hf, prompt, 12)[0]
    for kind, (_, compile_fn) in SPECS.items():
        assert got[kind] == oracle(hf, path, prompt, compile_fn, 40), kind
    text = {k: tok.decode(v) for k, v in got.items()}
    assert re.fullmatch("(yes|no)!", text["regex"]) and text["choice"] in ("red", "blue sky")
    value = json.loads(text["json_schema"])
    assert set(value) == {"color", "age"} and value["color"] in ("red", "blue")
    assert re.fullmatch("the (cat|dog)( and (cat|dog))?", text["ebnf"])


@pytest.mark.parametrize("guesses", ["ngram", "oracle", "wrong"])
def test_speculating_constrained_requests_keep_their_tokens(char_ckpt, guesses):
    """Speculative decoding over grammars: each row's mask is its grammar's after the guesses
    before it (the matcher looks ahead and rolls back). With n-gram guesses, with an oracle's
    (the run's own tokens: every one must be kept) and with guesses the grammars refuse (the
    rows after them allow every id and are never kept), the tokens are the one-token steps'."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from profiling.bench_speculative import Oracle
    path, _, tok = char_ckpt
    specs = [spec for spec, _ in SPECS.values()] + [("regex", "(ab|ba){4}c")]
    prompts = [tok.encode("the cat" + "." * i) for i in range(len(specs))]

    def run(llm):
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=40, grammar=s))
               for p, s in zip(prompts, specs)]
        while llm.has_unfinished():
            llm.step()
        return [llm.outputs[i] for i in ids], llm.stats()

    with _llm(path) as llm:
        want, _ = run(llm)
    with _llm(path, speculative_tokens=3) as llm:
        if guesses != "ngram":
            llm.engine.scheduler.drafter = Oracle(want, 3, prompts, wrong=guesses == "wrong",
                                                  vocab=VOCAB)
        got, stats = run(llm)
    assert got == want and all(len(w) > 1 for w in want)
    if guesses == "oracle":
        assert stats["speculative_accepted_tokens"] == stats["speculative_draft_tokens"] > 10
    if guesses == "wrong":
        assert stats["speculative_accepted_tokens"] == 0 < stats["speculative_draft_tokens"]


def test_a_grammar_joining_overlapped_steps_loses_no_token(char_ckpt):
    """Under overlap, the first step with a constrained request reads back the step in flight
    and then its own: a running request gets two tokens in that call, and both reach the
    LLM's outputs (the second had overwritten the first: 11 of 12 tokens)."""
    path, _, tok = char_ckpt
    runs = []
    for overlap in (False, True):
        with _llm(path, overlap=overlap) as llm:
            a = llm.add_request(tok.encode("hello"), SamplingParams(max_new_tokens=12,
                                                                    ignore_eos=True))
            for _ in range(4):
                llm.step()
            b = llm.add_request(tok.encode("x"), SamplingParams(max_new_tokens=8,
                                                                grammar=("regex", "o+k")))
            while llm.has_unfinished():
                llm.step()
            runs.append((llm.outputs[a], llm.outputs[b]))
    assert runs[0] == runs[1] and len(runs[1][0]) == 12


def test_sampled_tokens_stay_in_the_language(char_ckpt):
    path, _, tok = char_ckpt
    with _llm(path) as llm:
        ids = [llm.add_request(tok.encode("a"), SamplingParams(
            max_new_tokens=30, temperature=1.0, seed=s, grammar=("regex", "[0-9]{3}-(cat|dog)")))
            for s in range(6)]
        while llm.has_unfinished():
            llm.step()
        texts = [tok.decode(llm.outputs[i]) for i in ids]
    assert all(re.fullmatch("[0-9]{3}-(cat|dog)", t) for t in texts), texts
    assert len(set(texts)) > 1                      # the seeds draw different sentences


def test_kvp_ranks_apply_the_same_masks(char_ckpt):
    path, hf, tok = char_ckpt
    prompt = tok.encode("the dog")
    with _llm(path, Layout(kvp=2)) as llm:
        (rid,) = _run(llm, prompt, [SPECS["json_schema"][0]])
        got = llm.outputs[rid]
    assert got == oracle(hf, path, prompt, SPECS["json_schema"][1], 40)


def test_a_grammar_with_no_way_on_fails_its_request_only(hf_checkpoint, tmp_path):
    """The word-level tokenizer has "blue" but no "sky": after "blue" no token continues
    "bluesky", so that request ends with an error naming it; the one beside it is untouched."""
    src, hf = hf_checkpoint("llama")
    path = checkpoint_with_tokenizer(src, str(tmp_path / "llama-words"))
    with _llm(path) as llm:
        other = llm.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
        (rid,) = _run(llm, [5, 6, 7], [choice_spec(["bluesky"])])
        assert llm.finish_reasons[rid] == "error" and "outside the request's grammar" in \
            llm.errors[rid]
        assert llm.outputs[other] == hf_greedy(hf, [5, 6, 7], 6)[0]


def test_bad_grammars_are_refused_when_added(char_ckpt):
    path, _, tok = char_ckpt
    with _llm(path) as llm:
        for spec, why in ((("regex", "("), "the regex grammar does not compile: Regex"),
                          (("json_schema", "{"), "the json_schema grammar does not compile"),
                          (("ebnf", 'root ::= "a" | b'), 'Rule "b" is not defined')):
            with pytest.raises(RequestError, match=re.escape(why)) as e:
                llm.add_request([5], SamplingParams(grammar=spec))
            assert "\n" not in str(e.value) and "/project/" not in str(e.value)
        assert not llm.outputs                             # nothing was queued
        (rid,) = _run(llm, tok.encode("x"), [("regex", "ok")])
        assert tok.decode(llm.outputs[rid]) == "ok"
    with LLM("tiny-llama", Layout(), RuntimeConfig(**SMALL)) as llm:
        with pytest.raises(RequestError, match="need the checkpoint's tokenizer"):
            llm.add_request([5], SamplingParams(grammar=("regex", "a")))
    for bad in (("xml", "<a/>"), ("regex",), "regex"):
        with pytest.raises(RequestError, match="grammar must be"):
            SamplingParams(grammar=bad)
    with pytest.raises(RequestError, match="exclude each other"):
        SamplingParams(grammar=("regex", "a"), forced_tokens=(1,))
    with pytest.raises(RequestError, match="grammar and min_tokens exclude each other"):
        SamplingParams(grammar=("regex", "a"), min_tokens=2)
    for bad in ([], "ab", ["a", ""], [1]):
        with pytest.raises(RequestError, match="non-empty list"):
            choice_spec(bad)


def test_a_grammar_compiles_in_the_background_while_the_others_step(char_ckpt, monkeypatch):
    """The serving loop (EngineLoop, in this process over a pipe): a request whose grammar
    takes 1.5 s to compile is held back while a running request keeps getting tokens, then
    added and constrained as usual; a grammar that does not compile is refused after its
    compile, and a request aborted while its grammar compiles never runs."""
    import multiprocessing
    import threading
    import time

    from helix.runtime.grammar import Grammars
    from helix.serving.engine_loop import EngineLoop
    path, _, tok = char_ckpt
    slow = Grammars._compile

    def compile_slowly(comp, spec):
        time.sleep(1.5)
        return slow(comp, spec)

    monkeypatch.setattr(Grammars, "_compile", staticmethod(compile_slowly))
    with _llm(path) as llm:
        ours, theirs = multiprocessing.Pipe()
        loop = EngineLoop(llm, theirs)
        runner = threading.Thread(target=loop.run)
        runner.start()
        try:
            ours.send(("add", 1, tok.encode("ab"), SamplingParams(max_new_tokens=60,
                                                                  ignore_eos=True), None))
            ours.send(("add", 2, tok.encode("x"), SamplingParams(max_new_tokens=20,
                                                                 grammar=("regex", "o+k")), None))
            ours.send(("add", 3, tok.encode("x"), SamplingParams(grammar=("regex", "(")), None))
            ours.send(("add", 4, tok.encode("x"), SamplingParams(grammar=("regex", "z+")), None))
            ours.send(("abort", 4))
            events, text, t0 = [], {}, time.monotonic()
            while (len([e for e in events if e[0] == "finished"]) < 2
                   or not any(e[:2] == ("rejected", 3) for e in events)) and \
                    time.monotonic() - t0 < 60:
                if not ours.poll(1.0):
                    continue
                msg = ours.recv()
                if msg[0] in ("added", "rejected"):
                    events.append((msg[0], msg[1], time.monotonic() - t0))
                elif msg[0] == "out":
                    for key, t in zip(msg[1], msg[2]):
                        text[key] = text.get(key, "") + tok.decode([t])
                        events.append(("token", key, time.monotonic() - t0))
                    events += [("finished", f[0], time.monotonic() - t0) for f in msg[3]]
        finally:
            ours.send(("shutdown",))
            runner.join(30)
        added = {k: t for kind, k, t in events if kind == "added"}
        assert set(added) == {1, 2} and added[2] >= 1.4
        before = [t for kind, k, t in events if kind == "token" and k == 1 and t < added[2]]
        assert len(before) >= 5                      # request 1 stepped while 2 compiled
        assert ("rejected", 3) in [(kind, k) for kind, k, _ in events]
        assert 4 not in added and 4 not in text
        assert text[2].startswith("o") and set(text[2]) <= {"o", "k"}


def test_request_fields_give_grammars():
    schema = {"type": "object"}
    assert _grammar({"response_format": {"type": "json_object"}}) == ("json", "")
    assert _grammar({"response_format": {"type": "text"}}) is None
    assert _grammar({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}) == ("json_schema", json.dumps(schema))
    assert _grammar({"guided_json": json.dumps(schema)}) == ("json_schema", json.dumps(schema))
    assert _grammar({"guided_regex": "a+"}) == ("regex", "a+")
    assert _grammar({"guided_choice": ["a", "b"]}) == choice_spec(["a", "b"])
    assert _grammar({"guided_grammar": EBNF}) == ("ebnf", EBNF)
    assert _grammar({"structured_outputs": {"choice": ["x"]}}) == choice_spec(["x"])
    for body, field in (({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"guided_json": "{"}, "guided_json"),
                        ({"guided_regex": ""}, "guided_regex"),
                        ({"guided_choice": "a"}, "guided_choice"),
                        ({"structured_outputs": "a"}, "structured_outputs"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "response_format")):
        with pytest.raises(FieldError) as e:
            _grammar(body)
        assert e.value.param == field, body


def test_generate_flags(char_ckpt, capsys, tmp_path):
    from helix.cli import main
    path, _, _ = char_ckpt
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["generate", "--model", path, "--prompt", "the cat", "--max-new-tokens", "40",
            "--device", "cpu", "--max-context", "256", "--page-size", "4", "--json"]
    assert main(base + ["--json-schema", str(schema)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(json.loads(result["text"][0])) == {"color", "age"}
    assert main(base + ["--choice", "red,blue sky"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["text"][0] in ("red", "blue sky")
    assert main(base + ["--regex", "a", "--choice", "b"]) == 2
    assert "give one of --json-schema" in capsys.readouterr().err
    assert main(base + ["--json-schema", "nope"]) == 2
    assert "neither a file nor JSON" in capsys.readouterr().err


def test_no_xgrammar_is_a_one_line_error(monkeypatch, char_ckpt):
    import sys
    path, _, _ = char_ckpt
    monkeypatch.setitem(sys.modules, "xgrammar", None)      # import fails
    with _llm(path) as llm:
        with pytest.raises(RequestError, match=r'pip install -e "\.\[structured\]"'):
            llm.add_request([5], SamplingParams(grammar=("regex", "a")))
    assert os.path.isdir(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_steps_mask_as_eager_steps_do(char_ckpt):
    """Under decode and prefill graphs the mask applies after the replay: bitwise the tokens of
    the same bucketed steps run eagerly, every text a sentence of its language."""
    path, _, tok = char_ckpt
    prompt = tok.encode("the cat")

    def run(graph_eager: bool):
        rt = RuntimeConfig(device="cuda", dtype="bfloat16", page_size=16, max_batch=8,
                           max_context=256, graph_buckets=(1, 2, 4, 8),
                           attention_backend="triton", graph_eager=graph_eager)
        with LLM(path, Layout(), rt) as llm:
            free = llm.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
            ids = _run(llm, prompt, [spec for spec, _ in SPECS.values()])
            return [llm.outputs[i] for i in [free] + ids]
    captured = run(False)
    assert captured == run(True)
    text = [tok.decode(t) for t in captured[1:]]
    assert re.fullmatch("(yes|no)!", text[0]) and text[1] in ("red", "blue sky")
    assert set(json.loads(text[2])) == {"color", "age"}
