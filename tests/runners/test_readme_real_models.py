"""The README's "Real models" example runs as written (in a temporary directory)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_real_models_example_runs(tmp_path):
    section = README.read_text().split("## Real models", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in the README's Real models section"
    code = match.group(1).replace("/tmp/omni-models", str(tmp_path))
    namespace: dict = {"__name__": "readme_real_models"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)
    tokens = ast.literal_eval(out.getvalue().strip())  # the example prints the generated token ids
    assert isinstance(tokens, list) and 1 <= len(tokens) <= 8
    assert namespace["image"]["png"].startswith(b"\x89PNG") and len(namespace["image"]["sha256"]) == 64
