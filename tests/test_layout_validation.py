"""Invalid layouts fail once, in `Layout` / `Layout.validate`, with a message that names the fix,
and the API and the CLI report them before any worker process is spawned."""

from __future__ import annotations

import dataclasses
import multiprocessing
import re

import pytest

from helix import LLM, Layout, RuntimeConfig
from helix.cli import main as cli_main
from helix.errors import ConfigError
from helix.loader import read_model_config
from parallel_helpers import CASES, Case


def _cfg(model: str, **changes):
    cfg = read_model_config(model)[0]
    return dataclasses.replace(cfg, **changes) if changes else cfg


# -- the Layout dataclass alone ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    pytest.param(dict(kvp=0), r"kvp must be a positive integer, got 0", id="kvp0"),
    pytest.param(dict(tpa=-2), r"tpa must be a positive integer", id="tpa-negative"),
    pytest.param(dict(kv_interleave=0), r"kv_interleave must be a positive integer",
                 id="interleave0"),
    pytest.param(dict(kvp=2.0), r"kvp must be a positive integer", id="kvp-float"),
    pytest.param(dict(kvp=3, ep=2), r"ep=2 does not divide the world size kvp\*tpa=3: choose ep "
                 r"among the divisors of 3", id="ep-not-dividing-world"),
    pytest.param(dict(kvp=2, tpa=2, tpf=3, ep=1), r"tpf\*ep = 3\*1 must equal kvp\*tpa = 4: set "
                 r"--tpf 4", id="tpf-times-ep-not-world"),
    pytest.param(dict(kvp=4, tpf=1, ep=2), r"tpf\*ep = 1\*2 must equal kvp\*tpa = 4: set --tpf 2",
                 id="tpf-too-small"),
])
def test_layout_rejects(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Layout(**kwargs)


@pytest.mark.parametrize("kvp,tpa,ep,tpf", [(2, 2, 1, 4), (2, 2, 2, 2), (4, 1, 4, 1), (3, 1, 3, 1)])
def test_layout_derives_tpf(kvp, tpa, ep, tpf):
    lay = Layout(kvp=kvp, tpa=tpa, ep=ep)
    assert lay.tpf == tpf and lay.world_size == kvp * tpa == tpf * ep


# -- the layout against a model ------------------------------------------------------------------

INVALID = [  # model, config changes, layout, message
    pytest.param("tiny-llama", {}, dict(kvp=3), r"world size kvp\*tpa=3 does not fit this model "
                 r"\(8 query heads, FFN width 512\): use one of 1, 2, 4, 8",
                 id="gqa-heads-world3"),
    pytest.param("tiny-llama", {}, dict(kvp=2, tpa=4), r"tpa=4 must divide the 2 KV heads: choose "
                 r"tpa among the divisors of 2 and raise kvp instead", id="gqa-tpa-over-kv-heads"),
    pytest.param("tiny-llama-h6", {}, dict(kvp=3, tpa=2), r"tpa=2 must divide the 3 KV heads",
                 id="gqa-tpa-not-dividing-kv-heads"),
    pytest.param("tiny-llama", dict(num_heads=6, intermediate_size=384), dict(kvp=1, tpa=3),
                 r"tpa=3 and 2 KV heads: one must divide the other", id="tp-baseline-tpa3-hkv2"),
    pytest.param("tiny-deepseek-v3", {}, dict(kvp=2, tpa=2), r"MLA has one latent KV head: use "
                 r"tpa=1 \(got tpa=2\); put all 4 ranks on kvp, or use the TP baseline kvp=1",
                 id="mla-tpa2-kvp2"),
    pytest.param("tiny-qwen3-moe", dict(num_experts=6), dict(kvp=4, ep=4),
                 r"6 experts are not divisible by ep=4: choose ep among the divisors of 6",
                 id="moe-experts-ep"),
    pytest.param("tiny-qwen3-moe", dict(moe_intermediate_size=90), dict(kvp=4, ep=1),
                 r"expert width 90 is not divisible by tpf=4: raise ep", id="moe-width-tpf"),
    pytest.param("tiny-deepseek-v3", dict(moe_intermediate_size=2), dict(kvp=4, ep=4),
                 r"world size kvp\*tpa=4 does not fit this model .*: use one of 1, 2",
                 id="shared-expert-width"),
    pytest.param("tiny-llama", dict(intermediate_size=500), dict(kvp=8),
                 r"FFN width 500\): use one of 1, 2, 4$", id="ffn-width"),
]


@pytest.mark.parametrize("model,changes,layout,message", INVALID)
def test_validate_rejects(model, changes, layout, message):
    with pytest.raises(ConfigError, match=message):
        Layout(**layout).validate(_cfg(model, **changes))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_validate_accepts_the_tested_layouts(case: Case):
    case.layout.validate(_cfg(case.model))


@pytest.mark.parametrize("model,layout", [
    ("tiny-llama", dict(kvp=1, tpa=8)),             # TP baseline, KV replicated 4x
    ("tiny-deepseek-v3", dict(kvp=1, tpa=4, ep=2)),  # MLA TP baseline
    ("tiny-deepseek-v3", dict(kvp=8, ep=8)),         # MLA: every rank on kvp
])
def test_validate_accepts_baselines_and_wide_kvp(model, layout):
    Layout(**layout).validate(_cfg(model))


# -- before any process starts ------------------------------------------------------------------

@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if the LLM tries to start workers or a process group."""
    def spawn(*_a, **_k):
        raise AssertionError("workers were spawned for an invalid layout")
    monkeypatch.setattr(LLM, "_start_local", spawn)
    monkeypatch.setattr(LLM, "_start_torchrun", spawn)
    before = set(multiprocessing.active_children())
    yield
    assert set(multiprocessing.active_children()) <= before


BEFORE_SPAWN = [p for p in INVALID if not p.values[1]]  # presets as shipped


@pytest.mark.parametrize("model,changes,layout,message", BEFORE_SPAWN)
def test_llm_rejects_before_spawning(no_spawn, model, changes, layout, message):
    with pytest.raises(ConfigError, match=message):
        LLM(model, Layout(**layout), RuntimeConfig(page_size=8, max_context=64))


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny-deepseek-v3", "--kvp", "2", "--tpa", "2"], "MLA has one latent KV head"),
    (["--model", "tiny-llama", "--kvp", "3"], "use one of 1, 2, 4, 8"),
    (["--model", "tiny-qwen3-moe", "--kvp", "2", "--tpf", "1", "--ep", "1"],
     r"tpf\*ep = 1\*1 must equal kvp\*tpa = 2: set --tpf 2"),
    (["--model", "tiny-qwen3-moe", "--kvp", "2", "--ep", "4"],
     "ep=4 does not divide the world size"),
], ids=["mla-tpa2", "heads-world3", "tpf-ep", "ep-world"])
def test_cli_rejects_before_spawning(no_spawn, capsys, args, message):
    """One line on stderr, exit code 2, no traceback, no worker."""
    code = cli_main(["generate", *args, "--prompt-ids", "5,17,42", "--device", "cpu", "--json"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("helix: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert re.search(message, err), err
