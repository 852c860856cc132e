"""Where the files that ship beside the code are: the TLA+ spec (`tla/`), the protocol's
requirements, wire schema and OpenAPI document (`specs/`) and the example configs (`examples/`).

A checkout keeps each folder once, at its top level, where it is edited and reviewed. A wheel
carries a copy under `omni_core/_data/` (setup.py copies them in at build time), so an
installed package finds its copy and a checkout, an editable install included, finds the top
level. Standard library only: `protocol/` and `fsm/` never need it, everything above may.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = ("tla", "specs", "examples")
DATA_PACKAGE_DIR = "_data"  # omni_core/_data/<name> inside a wheel

_WHAT = {
    "tla": "the TLA+ spec (tla/)",
    "specs": "the protocol's specification and schemas (specs/)",
    "examples": "the example configs (examples/)",
}


class MissingDataError(FileNotFoundError):
    """A shipped folder or file is not in this install: says where it looked and what to do."""


def candidates(name: str, package_dir: Path | None = None) -> tuple[Path, Path]:
    """The installed copy, then the checkout's top level."""
    package = package_dir or Path(__file__).resolve().parent
    return package / DATA_PACKAGE_DIR / name, package.parent / name


def data_dir(name: str, package_dir: Path | None = None) -> Path:
    """The folder `name` (one of SHIPPED); raises MissingDataError naming where it looked."""
    if name not in SHIPPED:
        raise ValueError(f"{name!r} is not a shipped folder; they are {', '.join(SHIPPED)}")
    found = [c for c in candidates(name, package_dir) if c.is_dir()]
    if found:
        return found[0]
    installed, checkout = candidates(name, package_dir)
    raise MissingDataError(
        f"{_WHAT[name]} is not in this install of omni-core: neither {installed} nor {checkout} exists. "
        "Reinstall omni-core from a wheel (pip install omni-core, or `pip wheel --no-deps .` in a checkout: "
        "the build copies tla/, specs/ and examples/ into it), or run from a checkout."
    )


def data_file(name: str, relative: str, package_dir: Path | None = None) -> Path:
    """One file inside a shipped folder; raises MissingDataError when the folder or it is missing."""
    path = data_dir(name, package_dir) / relative
    if not path.is_file():
        raise MissingDataError(
            f"{path} is missing from {_WHAT[name]} of this install of omni-core; "
            "reinstall omni-core or restore it from a checkout (git checkout -- "
            f"{name}/{relative})."
        )
    return path
