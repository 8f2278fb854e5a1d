"""The same CLI under torchrun (every rank started by torchrun, ranks > 0 serving rank 0) gives
the tokens of a single-process run."""

from __future__ import annotations

import json
import subprocess
import sys

ARGS = ["generate", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--prompt-ids", "9,8",
        "--max-new-tokens", "5", "--json"]


def _tokens(cmd: list[str]) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_torchrun_two_ranks_match_single_process():
    single = _tokens([sys.executable, "-m", "helix.cli", *ARGS])
    multi = _tokens([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "-m", "helix.cli", *ARGS, "--kvp", "2"])
    assert multi["tokens"] == single["tokens"]
    assert multi["world_size"] == 2 and sum(multi["kv_tokens_per_rank"]) == 3 + 4 + 2 + 4
