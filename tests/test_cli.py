"""The `helix` command line. Parsing, validation and output in-process (helix.cli.main); a few
end-to-end runs as a user runs it (a subprocess): the console script, the JSON line against
transformers, the demo. User errors: non-zero exit, one error line on stderr, no traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hf_fixtures import VOCAB, hf_greedy

from helix import LLM, Layout, RuntimeConfig, SamplingParams

PROMPTS = [[5, 17, 42], list(range(10, 50)), [77]]
HELIX = [sys.executable, "-m", "helix.cli"]


def helix(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([*HELIX, *args], capture_output=True, text=True, timeout=timeout, env=env)


def helix_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """helix.cli.main in this process: (returncode, stdout, stderr) like a subprocess."""
    from helix.cli import main
    try:
        code = main(list(args))
    except SystemExit as e:            # argparse: --help, usage errors
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def ids(p: list[int]) -> str:
    return ",".join(map(str, p))


def generate_args(model: str, prompts=PROMPTS, new: int = 16, *extra: str) -> list[str]:
    args = ["generate", "--model", model, "--max-new-tokens", str(new), "--device", "cpu",
            "--dtype", "float32", "--max-context", "256", "--page-size", "4"]
    for p in prompts:
        args += ["--prompt-ids", ids(p)]
    return [*args, *extra]


def test_generate_json_matches_transformers(hf_checkpoint):
    path, hf = hf_checkpoint("llama")
    r = helix(*generate_args(path, PROMPTS, 16, "--json", "--ignore-eos"))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [hf_greedy(hf, p, 16)[0] for p in PROMPTS]
    assert result["finish_reasons"] == ["length"] * 3
    assert result["world_size"] == 1 and result["dtype"] == "float32" and result["device"] == "cpu"
    assert result["kv_tokens_per_rank"] == [sum(len(p) + 15 for p in PROMPTS)]
    assert len(result["step_ms"]) == 16


def test_generate_logprobs_flag(llama_ckpt, capsys):
    r = helix_here(capsys, *generate_args(llama_ckpt, PROMPTS[:2], 4, "--json", "--logprobs",
                                          "2", "--prompt-logprobs", "1"))
    result = json.loads(r.stdout.strip().splitlines()[-1])
    with LLM(llama_ckpt, Layout(), RuntimeConfig(max_context=256, page_size=4)) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=4, logprobs=2,
                                                 prompt_logprobs=1)) for p in PROMPTS[:2]]
        while llm.has_unfinished():
            llm.step()
        want = [[{"logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                 for lp in llm.logprobs[i]] for i in ids]
        prompt = [[None] + [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                            for lp in llm.prompt_logprobs[i][1:]] for i in ids]
    assert result["logprobs"] == want and len(want[0]) == len(result["tokens"][0])
    assert result["prompt_logprobs"] == prompt and len(prompt[1]) == len(PROMPTS[1])
    r = helix_here(capsys, *generate_args(llama_ckpt, PROMPTS[:1], 2, "--logprobs", "21"))
    assert r.returncode == 2 and "logprobs must be in" in r.stderr


def test_generate_text_output_and_sampling_flags(llama_ckpt, capsys):
    r = helix_here(capsys, *generate_args(llama_ckpt, PROMPTS[:2], 5, "--temperature", "0.8",
                                          "--top-k", "20", "--top-p", "0.9", "--sample-seed",
                                          "11", "--ignore-eos"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [re.sub(r" \(.*", "", line) for line in lines[:2]] == ["request 0", "request 1"]
    assert lines[0].startswith("request 0 (3 prompt tokens -> 5 new, length)")
    assert lines[2].startswith("layout kvp=1 tpa=1 tpf=1 ep=1 kv_interleave=1 on 1 CPU rank")
    assert re.match(r"time to first token [\d.]+-[\d.]+ ms, decode [\d.]+ ms/step", lines[3])
    assert lines[4] == f"KV positions held per rank (layer 0): rank 0: {3 + 4 + 40 + 4}"
    got = [[int(t) for t in line.split(":")[1].split()] for line in lines[:2]]
    params = SamplingParams(max_new_tokens=5, temperature=0.8, top_k=20, top_p=0.9, seed=11,
                            ignore_eos=True)
    with LLM(llama_ckpt, Layout(), RuntimeConfig(max_context=256, page_size=4)) as llm:
        assert got == llm.generate(PROMPTS[:2], params)


def test_stop_ids_flag(llama_ckpt, capsys):
    r = helix_here(capsys, *generate_args(llama_ckpt, PROMPTS[1:2], 12, "--json"))
    full = json.loads(r.stdout.strip().splitlines()[-1])["tokens"][0]
    k = next(k for k in range(2, len(full)) if full[k] not in full[:k])
    r = helix_here(capsys, *generate_args(llama_ckpt, PROMPTS[1:2], 12, "--json", "--stop-ids",
                                          str(full[k])))
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [full[:k + 1]] and result["finish_reasons"] == ["stop"]


def test_console_script_installed(llama_ckpt):
    exe = os.path.join(os.path.dirname(sys.executable), "helix")
    exe = exe if os.path.exists(exe) else shutil.which("helix")
    assert exe, "the `helix` console script is not installed"
    r = subprocess.run([exe, *generate_args(llama_ckpt, PROMPTS[:1], 2, "--json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["tokens"][0]) == 2


def _bad_arch(root: str) -> str:
    path = os.path.join(root, "gpt2")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}, f)
    return path


def _corrupt(root: str, src: str) -> str:
    path = os.path.join(root, "corrupt")
    shutil.copytree(src, path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\x00" * 64)
    return path


USER_ERRORS = {  # id -> (args builder(ckpt, tmp), text the one stderr line must contain)
    "missing-path": (lambda c, t: generate_args(os.path.join(t, "nope"), PROMPTS, 2), "not found"),
    "unsupported-arch": (lambda c, t: generate_args(_bad_arch(t), PROMPTS, 2),
                         "unsupported architecture 'GPT2LMHeadModel'"),
    "corrupt-weights": (lambda c, t: generate_args(_corrupt(t, c), PROMPTS, 2), "safetensors"),
    "token-out-of-vocab": (lambda c, t: generate_args(c, [[1, VOCAB]], 2),
                           "outside the vocabulary"),
    "prompt-too-long": (lambda c, t: generate_args(c, [list(range(100)) * 3], 2),
                        "maximum context"),
    "empty-prompt": (lambda c, t: generate_args(c, [[]], 2), "empty prompt"),
    "no-prompt": (lambda c, t: generate_args(c, [], 2), "--prompt-ids"),
    "prompt-not-ids": (lambda c, t: [*generate_args(c, [], 2), "--prompt-ids", "1,x"],
                       "not a comma-separated list"),
    "negative-id": (lambda c, t: [*generate_args(c, [], 2), "--prompt-ids", "-1,2"],
                    "token ids are non-negative integers"),
    "ep-on-dense": (lambda c, t: generate_args(c, PROMPTS, 2, "--ep", "2", "--kvp", "2"),
                    "needs a mixture-of-experts model"),
    "nan-temperature": (lambda c, t: generate_args(c, PROMPTS, 2, "--temperature", "nan"),
                        "temperature must be a finite number"),
    "bad-penalty": (lambda c, t: generate_args(c, PROMPTS, 2, "--presence-penalty", "5"),
                    "presence_penalty must be in [-2, 2]"),
    "num-pages-too-large": (lambda c, t: generate_args(c, PROMPTS, 2, "--num-pages",
                                                       str(10**12)), "lower --num-pages"),
    "zero-new-tokens": (lambda c, t: generate_args(c, PROMPTS, 0), "max_new_tokens"),
    "bad-layout": (lambda c, t: generate_args(c, PROMPTS, 2, "--kvp", "3"), "world size"),
    "context-over-model": (lambda c, t: [*generate_args(c, PROMPTS, 2), "--max-context", "9999"],
                           "max_context"),
    "missing-model-flag": (lambda c, t: ["generate", "--prompt-ids", "1"], "--model"),
    "unknown-command": (lambda c, t: ["serve-forever"], "invalid choice"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_error_is_one_line(llama_ckpt, tmp_path, case, capsys):
    build, text = USER_ERRORS[case]
    r = helix_here(capsys, *build(llama_ckpt, str(tmp_path)))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("helix: KV pool")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("helix: error:") and text in errors[0], errors[0]
    assert r.stdout == ""


def test_user_error_in_a_subprocess_is_one_line(llama_ckpt):
    r = helix(*generate_args(llama_ckpt, [[1, VOCAB]], 2))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(f"outside the vocabulary [0, {VOCAB})")


def test_help_version_and_models(capsys):
    r = helix_here(capsys, "generate", "--help")
    assert r.returncode == 0 and "--prompt-ids" in r.stdout and "--kvp" in r.stdout
    r = helix_here(capsys, "--version")
    assert r.returncode == 0 and re.match(r"helix \d+\.\d+", r.stdout)
    r = helix_here(capsys, "models")
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()[1:-1]}
    assert rows["llama-3.1-8b"][1:6] == ["llama", "32", "4096", "32/8", "-"]
    assert rows["llama-3.1-8b"][-1] == "8.0B"
    assert rows["deepseek-v3"][4:6] == ["128/MLA", "256x8"]
    r = helix_here(capsys, "generate", "--kvp")
    assert r.returncode == 2 and "(see helix generate --help)" in r.stderr


def test_demo():
    """The demo as a user runs it (its default Helix layout, CPU ranks), with a small context.
    Its tokens must equal a single-process run of the same prompts."""
    r = helix("demo", "--max-context", "128", timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Traceback" not in r.stderr
    rows = re.findall(r"prompt of +(\d+) tokens -> (\d+) new \((\w+)\): ([\d ]+)", out)
    assert [(int(n), int(k), why) for n, k, why, _ in rows] == [(5, 24, "length"),
                                                                (23, 24, "length"),
                                                                (61, 24, "length")]
    held = [int(x) for x in re.findall(r"rank \d+: (\d+)", out.split("per rank (layer 0):")[1])]
    total = int(re.search(r"(\d+) positions written in all", out).group(1))
    assert total == sum(n + 23 for n in (5, 23, 61)) and sum(held) == total and len(held) >= 1
    # the demo's prompts: torch.randint(0, 1000) from a generator seeded with --seed (0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 23, 61)]
    with LLM("tiny-llama", Layout(), RuntimeConfig(max_context=128)) as llm:
        want = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [[int(t) for t in row[3].split()] for row in rows] == want


def test_prefix_caching_flag():
    import argparse

    from helix.commands.options import add_layout_args, add_runtime_args, configs
    p = argparse.ArgumentParser()
    add_layout_args(p)
    add_runtime_args(p)
    assert configs(p.parse_args(["--device", "cpu"]))[1].prefix_caching
    assert not configs(p.parse_args(["--device", "cpu", "--no-prefix-caching"]))[1].prefix_caching


def test_host_cache_flag_and_its_rule():
    import argparse

    from helix.commands.options import add_layout_args, add_runtime_args, configs
    from helix.errors import ConfigError
    p = argparse.ArgumentParser()
    add_layout_args(p)
    add_runtime_args(p)
    assert configs(p.parse_args(["--device", "cpu", "--host-cache-gb", "4"]))[1].host_cache_gb == 4
    with pytest.raises(ConfigError, match="needs prefix_caching"):
        configs(p.parse_args(["--device", "cpu", "--host-cache-gb", "4", "--no-prefix-caching"]))
    with pytest.raises(ConfigError, match="host_cache_gb must be a finite number >= 0"):
        RuntimeConfig(host_cache_gb=-1)
