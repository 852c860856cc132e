"""What the small generated TLA+ modules share: freshness against what renders them, writing,
and the `python -m ...` entry point that rewrites or checks the committed file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_core.formal.manifest import tla_dir


@dataclass(frozen=True)
class Generated:
    module: str  # the TLA+ module's name, and its file's under tla/
    regen_command: str
    source: str  # what renders it, named in the stale message
    holds: str  # what the module holds, named when it is missing
    render: Callable[[], str]

    def default_path(self) -> Path:
        """The module under `tla/` of the checkout this package lives in, or of the wheel's copy."""
        return tla_dir() / f"{self.module}.tla"

    def is_fresh(self, path: Path | None = None) -> bool:
        path = path or self.default_path()
        return path.is_file() and path.read_text() == self.render()

    def stale_message(self, path: Path) -> str:
        if not path.is_file():
            return (
                f"{path} is missing: this install of omni-core has no {self.holds} there. In a checkout: "
                f"git checkout -- tla/ (or {self.regen_command}); an installed omni-core: reinstall it from a "
                "wheel"
            )
        return f"{path} differs from what {self.source} renders; run {self.regen_command}"

    def write(self, path: Path | None = None) -> bool:
        """Write the module; True when the file changed."""
        path = path or self.default_path()
        text = self.render()
        if path.is_file() and path.read_text() == text:
            return False
        path.write_text(text)
        return True

    def main(self, argv: list[str] | None, doc: str) -> int:
        parser = argparse.ArgumentParser(prog=self.regen_command, description=doc.splitlines()[0])
        parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
        args = parser.parse_args(argv)
        path = self.default_path()
        if args.check:
            if self.is_fresh(path):
                print(f"{path}: up to date")
                return 0
            print(self.stale_message(path), file=sys.stderr)
            return 1
        print(f"{path}: {'written' if self.write(path) else 'unchanged'}")
        return 0
