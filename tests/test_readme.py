"""The README's embedding example runs as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(after_heading: str) -> str:
    text = README.read_text()
    section = text.split(after_heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block after {after_heading!r}"
    return match.group(1)


def test_readme_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert block[0].startswith("bash scripts/setup.sh && .venv/bin/omni-core demo")
    assert block[1].startswith("bash scripts/test.sh")
    ci_lines = (README.parent / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/test.sh" in ci_lines, ".ci/run must run the README's test command"


def test_embedding_example_runs() -> None:
    code = _python_block("## Embedding it")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().startswith("SLEEPING ")


def test_swap_example_runs() -> None:
    code = _python_block("## Swapping two stages")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_swap"})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("SLEEPING RUNNING swap-talker-decoder-") and lines[0].endswith("/in"), lines
    assert lines[1] == "SLEEPING NoMemoryError SLEEPING", lines
    assert "refused, nothing it mapped is kept" in lines[2] and "holders: stage trainer rank 0, pid" in lines[2]
    assert lines[3] == "RUNNING", lines
