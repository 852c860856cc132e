"""`omni-core reload | restart | execute STAGE --url URL` against a real `omni-core serve`."""

from __future__ import annotations

import json

import torch

from omni_core.cli import main as cli_main
from tests.serve.conftest import make_config, serving, stage_table


def test_reload_restart_and_execute_from_the_command_line(capsys) -> None:
    with serving(make_config(stage_table("talker"))) as served:
        url = ["--url", served.url]
        assert cli_main(["execute", "talker", "--payload", '{"seed": 1, "batch": 1}', *url]) == 0
        first = json.loads(capsys.readouterr().out)
        assert first is not None

        served.engine.sleep("talker", level=2)
        served.engine.wake("talker")
        assert served.engine.status()["talker"]["state"] == "NEEDS_RELOAD"
        # Refused, with the command that fixes it.
        assert cli_main(["execute", "talker", "--payload", '{"seed": 1, "batch": 1}', *url]) == 1
        err = capsys.readouterr().err
        assert "NEEDS_RELOAD" in err and f"to fix: omni-core reload talker --url {served.url}" in err, err

        assert cli_main(["reload", "talker", *url]) == 0
        assert "-> RUNNING (OK)" in capsys.readouterr().out
        assert cli_main(["execute", "talker", "--payload", '{"seed": 1, "batch": 1}', *url]) == 0
        assert json.loads(capsys.readouterr().out) == first  # the same weights, reloaded

        epoch = served.engine.status()["talker"]["epoch"]
        assert cli_main(["restart", "talker", "--json", *url]) == 0
        restarted = json.loads(capsys.readouterr().out)
        assert restarted["state"] == "RUNNING" and restarted["epoch"] == epoch + 1

        restart = ["restart", "talker", "--idempotency-key", "cli-restart-1", *url]
        assert cli_main(restart) == 0
        assert "replayed" not in capsys.readouterr().err
        assert cli_main(restart) == 0
        again = capsys.readouterr()
        assert "replayed: this is the answer to the first request with Idempotency-Key 'cli-restart-1'" in again.err
        assert served.engine.status()["talker"]["epoch"] == epoch + 2  # one restart for the key, not two

        # A restart says the version it came back at; --from-checkpoint says what it reset.
        served.engine.update_weights("talker", "seed:9", version=7)
        assert cli_main(["restart", "talker", *url]) == 0
        assert "weights version 7" in capsys.readouterr().out
        assert cli_main(["restart", "talker", "--from-checkpoint", *url]) == 0
        out = capsys.readouterr().out
        assert "weights version 0" in out and "reset from 7 to 0" in out, out

        # A version from memory is lost with its ranks: the refusal names the two ways out.
        from omni_core.runners.synthetic import SyntheticRunner
        from omni_core.weights_sender import WeightSender
        from tests.serve.conftest import SMALL_RUNNER

        specs = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=6)).weight_specs()
        with WeightSender(bucket_bytes=1 << 20) as sender:
            weights = {name: torch.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in specs.items()}
            served.engine.update_weights("talker", sender.share(weights), version=2)
        assert cli_main(["restart", "talker", *url]) == 0
        assert "NEEDS_RELOAD" in capsys.readouterr().out
        assert cli_main(["execute", "talker", "--payload", '{"seed": 1, "batch": 1}', *url]) == 1
        err = capsys.readouterr().err
        assert "to fix: omni-core update-weights talker --version FLOOR, or omni-core restart talker" in err, err

        assert cli_main(["execute", "talker", "--payload", "{seed", *url]) == 2
        assert "--payload is not JSON" in capsys.readouterr().err


def test_pause_and_resume_from_the_command_line(capsys) -> None:
    with serving(make_config(stage_table("talker", admission="reject"))) as served:
        url = ["--url", served.url]
        assert cli_main(["pause", "talker", "--mode", "keep", *url]) == 0
        assert capsys.readouterr().out.startswith("talker: Pause -> PAUSED (OK) in ")
        assert served.engine.is_paused("talker")
        # The policy 'reject' refuses while paused, naming the command that fixes it.
        assert cli_main(["execute", "talker", "--payload", '{"seed": 1, "batch": 1}', *url]) == 1
        err = capsys.readouterr().err
        assert "PAUSED" in err and f"to fix: omni-core resume talker --url {served.url}" in err, err
        # The deadline goes to the server, which checks it as any call's (nothing resumed).
        assert cli_main(["resume", "talker", "--timeout-s", "0", *url]) == 1
        assert "timeout_s must be a positive number" in capsys.readouterr().err
        assert served.engine.is_paused("talker")
        assert cli_main(["resume", "talker", "--timeout-s", "5", "--json", *url]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == "RUNNING"
        assert cli_main(["resume", "talker", *url]) == 0
        assert "-> RUNNING (ALREADY)" in capsys.readouterr().out
