"""Tidy: every function in omni_core/ fits in 70 lines (TigerBeetle's tidy.zig rule).

A function's own lines are counted: a nested function or class is a unit of its own, counted
by itself (a route factory holds many short routes). The allowlist below is what is still
over, each with why; an entry that is no longer over must leave the list, so it only shrinks.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "omni_core"
MAX_FUNCTION_LINES = 70

# module path : function -> why it is still longer
ALLOWED_LONG = {
    # Declarations read top to bottom: one statement per option or metric, nothing to cut out.
    "cli.py:build_parser": "the CLI's argparse declaration, one add_argument per option",
    "formal/check.py:add_arguments": "`omni-core check`'s argparse declaration",
    "serve/metrics.py:__init__": "the metric families, declared one by one",
    # To be cut by what they own (issue 38): each is a sequence of phases today.
    "serve/core_routes.py:router": "route registrations with their shared closures",
    "serve/metrics.py:collect": "one pass over every stage's status per scrape",
    "formal/check.py:run": "TLC runs, then controls, then the report",
    "fsm/worker.py:_on_command": "the worker core's per-command guards",
    "workers/process.py:start": "the rank's start-up: device, backend, runner, Hello",
    "formal/trace_check.py:judge": "the trace verdict's checks in order",
    "formal/trace_export.py:project": "a trace's projection onto the spec's variables",
}


def _nested_lines(node: ast.AST) -> int:
    total = 0
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            total += child.end_lineno - child.lineno + 1  # type: ignore[operator]
        else:
            total += _nested_lines(child)
    return total


@functools.cache
def long_functions() -> dict[str, int]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own = node.end_lineno - node.lineno + 1 - _nested_lines(node)  # type: ignore[operator]
                if own > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = own
    return found


def test_every_function_fits_in_70_lines_or_says_why() -> None:
    over = long_functions()
    unexplained = {name: lines for name, lines in over.items() if name not in ALLOWED_LONG}
    assert not unexplained, (
        f"functions over {MAX_FUNCTION_LINES} lines (their own, nested functions apart): {unexplained}; "
        "cut them by what they do (a helper per phase), or explain one in ALLOWED_LONG"
    )


def test_the_allowlist_only_shrinks() -> None:
    over = long_functions()
    stale = sorted(name for name in ALLOWED_LONG if name not in over)
    assert not stale, f"{stale} fit in {MAX_FUNCTION_LINES} lines now: remove them from ALLOWED_LONG"
