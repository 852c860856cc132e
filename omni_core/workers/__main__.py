"""`python -m omni_core.workers --config JSON`: start one worker from the command line.

JSON is a WorkerConfig object, inline or as @path to a file holding it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec

from omni_core.workers.config import WorkerConfig


def parse_config(text: str) -> WorkerConfig:
    raw = Path(text[1:]).read_bytes() if text.startswith("@") else text.encode()
    try:
        return msgspec.json.decode(raw, type=WorkerConfig)
    except msgspec.DecodeError as exc:
        raise SystemExit(
            f"--config is not a valid WorkerConfig: {exc}. Example: "
            '--config \'{"address": "ipc:///tmp/omni.sock", "rank": 0}\''
        ) from None


def main(argv: list[str] | None = None) -> int:
    parent_pid = os.getppid()  # before the slow imports: a parent may die meanwhile
    parser = argparse.ArgumentParser(prog="python -m omni_core.workers", description=__doc__)
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON, or @file.json")
    args = parser.parse_args(argv)
    from omni_core.workers.process import run_worker  # torch import only once the args are valid

    return run_worker(parse_config(args.config), parent_pid=parent_pid)


if __name__ == "__main__":
    sys.exit(main())
