"""The worker fuzzer's view of the worker's log: a frame that raised into the isolation is
reported with its own traceback, however many lines later frames wrote after it."""

from __future__ import annotations

from omni_core.isolation import LOG_MARK
from omni_testing.fuzz.worker_spawn import EXCERPT_LINES, MAX_EXCERPTS, handler_raised_excerpts, handler_raised_lines


def test_each_isolation_line_is_kept_with_its_traceback(tmp_path) -> None:
    log = tmp_path / "worker.log"
    lines = ["start\n"]
    for n in range(MAX_EXCERPTS + 1):
        lines += [f"ERROR worker: RecursionError {LOG_MARK} frame {n}\n", f"  File frame{n}.py\n"]
        lines += [f"ERROR worker: refused {k}\n" for k in range(500)]  # later frames' lines
    log.write_text("".join(lines))
    excerpts = handler_raised_excerpts(str(log))
    assert handler_raised_lines(str(log)) == MAX_EXCERPTS + 1
    for n in range(MAX_EXCERPTS):
        assert f"{LOG_MARK} frame {n}\n  File frame{n}.py\n" in excerpts
    assert f"frame {MAX_EXCERPTS}" not in excerpts  # bounded
    assert len(excerpts.splitlines()) == MAX_EXCERPTS * EXCERPT_LINES
    assert handler_raised_excerpts(str(tmp_path / "none.log")) == ""
