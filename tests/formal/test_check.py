"""`omni-core check`: every model passes and every bug model fails with its invariant.

One full run (all models, bug models and controls) takes about 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time

import pytest

from omni_core.cli import main as cli_main
from omni_core.formal import check


def test_cli_lists_every_manifest_model(capsys):
    assert cli_main(["check", "--list"]) == 0
    assert cli_main(["check", "--list", "--long"]) == 0  # the long models are listed apart
    out = capsys.readouterr().out
    _, models = check.load_manifest(check.tla_dir())
    assert len(models) >= 7 + 4
    for m in models:
        assert m.name in out
        assert (check.tla_dir() / m.config).is_file()
        assert (check.tla_dir() / m.spec).is_file(), m.spec  # the entry's own spec, else the manifest's
    bugs = {m.name: m.expect for m in models if m.is_bug}
    # The four defects of the issue, with the invariant each must break.
    assert bugs["bug/no_reply_cache"] == "P2_NoTaskAppliedTwice"
    assert bugs["bug/commit_before_all_acks"] == "P5_CommitOnlyOnAllAcks"
    assert bugs["bug/execute_in_partial"] == "P7_ExecuteOnlyWhenResident"
    assert bugs["bug/no_epoch_fence"] == "P6_StaleNeverChangesState"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_model_and_bug_model_gives_its_expected_result():
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    lines: list[str] = []
    start = time.monotonic()
    code = check.run(parser.parse_args([]), echo=lines.append)
    elapsed_s = time.monotonic() - start
    table = "\n".join(lines)
    print(f"\n{table}\n(omni-core check: {elapsed_s:.1f} s)")
    assert code == 0, table
    _, models = check.load_manifest(check.tla_dir())
    for m in check.select(models, long=False, only=None):
        row = next(line for line in lines if line.startswith(m.name + " "))
        assert row.split()[1:3] == [m.expect, m.expect] and row.rstrip().endswith("ok"), row
        if m.is_bug:
            control = next(line for line in lines if line.startswith(f"{m.name} [Bug=none]"))
            assert control.rstrip().endswith("ok"), control
