"""The README's Python snippet runs as pasted into a script (two KVP ranks on CPU)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_api_snippet_runs_as_a_script(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                   if "from helix import LLM" in b)
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = (ast.literal_eval(x) for x in re.findall(r"\[[\d, ]*\]", res.stdout.strip()))
    assert len(a) == 8 and len(b) == 8
