"""The model manifest (`tla/manifest.json`): every TLC model and bug model with what it must
give. Read by the model checker (`check`) and by the guard mutation (`guard_mutation`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omni_core.resources import data_dir

MANIFEST = "manifest.json"


def tla_dir() -> Path:
    """The spec folder: the checkout's `tla/`, or the copy an installed wheel carries. Raises
    `omni_core.resources.MissingDataError` (a FileNotFoundError) naming both places when neither is there."""
    return data_dir("tla")


@dataclass(frozen=True)
class Model:
    """One manifest entry. `expect` is "ok", an invariant name, or a temporal property name
    (`kind` "temporal"). `distinct_states` is what TLC reported when the manifest was last
    written; `control_states` the same for a bug model's control run. `spec` is the module
    it checks: the entry's own `spec` key, else the manifest's (OmniSleep.tla)."""

    name: str
    config: str
    expect: str
    kind: str  # "model", "bug" or "temporal" (a bug model that breaks a temporal property)
    workers: int
    distinct_states: int | None
    control_states: int | None
    about: str
    spec: str = ""  # the module the config is for: the entry's own, else the manifest's
    long: bool = False  # run only by --long
    seconds: float | None = None  # measured by the last --update-manifest (the manifest says where)

    @property
    def is_bug(self) -> bool:
        return self.kind in ("bug", "temporal")

    @classmethod
    def from_json(cls, data: dict, default_spec: str = "") -> Model:
        return cls(
            name=data["name"],
            config=data["config"],
            expect=data["expect"],
            kind=data.get("kind", "model"),
            workers=int(data.get("workers", 2)),
            distinct_states=data.get("distinct_states"),
            control_states=data.get("control_states"),
            about=data.get("about", ""),
            spec=data.get("spec", default_spec),
            long=bool(data.get("long", False)),
            seconds=data.get("seconds"),
        )


def load_manifest(root: Path) -> tuple[dict, list[Model]]:
    data = json.loads((root / MANIFEST).read_text())
    return data, [Model.from_json(m, data["spec"]) for m in data["models"]]
