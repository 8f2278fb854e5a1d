"""The sm_90 compile checks' one way to run (tests marked `sm90`, no GPU needed): a Python
command in a subprocess with Triton's interpreter off (TRITON_INTERPRET unset, so kernels compile
for real), a private Triton cache, and the repository importable. Skips where the Triton wheel
ships no ptxas / cuobjdump."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, argv: list[str], timeout: float = 300,
        fp_fusion: bool = False) -> subprocess.CompletedProcess:
    """`python *argv` from the repository root; asserts it exits 0 (its stderr tail otherwise).
    fp_fusion: TRITON_DEFAULT_FP_FUSION=1, the JIT's default (launches that pass
    enable_fp_fusion themselves keep theirs)."""
    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("this triton wheel ships no ptxas / cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    if fp_fusion:
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res
