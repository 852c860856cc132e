"""The coverage-guided codec target (atheris), where atheris installs from a wheel.

scripts/test.sh installs it when pip finds a binary wheel for this Python; otherwise this
skips and the structured fuzzer covers the codec (test_generator, test_fuzz_short).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from omni_testing.fuzz.generate import write_seed_corpus

pytest.importorskip("atheris")


def test_codec_survives_coverage_guided_inputs(tmp_path) -> None:
    write_seed_corpus(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_testing.fuzz.atheris_codec",
            "-atheris_runs=20000",
            "-max_len=4096",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"Done 20000 (runs|in)", result.stderr), result.stderr[-2000:]
    # Guided, not blind: the codec's Python paths are instrumented and new edges were found.
    edges = [int(m) for m in re.findall(r"cov: (\d+)", result.stderr)]
    assert edges and max(edges) >= 20, result.stderr[-2000:]
