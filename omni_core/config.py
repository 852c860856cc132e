"""Stage configuration files: TOML describing stages exactly as `StageSpec` does, plus the
`[server]` settings of `omni-core serve` and the `[engine]` arguments of `Engine`.

Every error names the file, the stage (by name and position) and the field, and says what
would be accepted, so a typo is fixed from the message alone:

    examples/bad.toml: stage 'talker' (stages[0]): field 'ranks': expected an integer, got '2'

```toml
[server]                         # omni-core serve only; every key optional
host = "127.0.0.1"
port = 8000
default_stage = "talker"         # what vLLM's /sleep, /wake_up ... act on; absent: every stage

[engine]                         # Engine(...) keyword arguments; optional
transport = "ipc"

[[stages]]                       # one table per StageSpec, in order (vLLM-Omni's stage_ids index them)
name = "talker"
runner = "synthetic"
ranks = 2
[stages.runner_args]
weights_bytes = 2097152
```
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.spec import RayPlacement, StageSpec
from omni_core.workers.simulated_device import SimulatedDevice

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:  # the serve extra installs it there
        tomllib = None

DEFAULT_PORT = 8000
DEFAULT_API_KEY_ENV = "OMNI_CORE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # execute payloads are small control messages, not tensors
MAX_BODY_BYTES_LIMIT = 1 << 30
MIN_API_KEY_CHARS = 16  # shorter keys can be guessed over a network in reasonable time
# A stage configuration is a few KiB; past this, the path is wrong (a model file, a log) and
# parsing it whole would only spend memory and time before failing.
MAX_CONFIG_BYTES = 1 << 20


class ConfigError(InvalidArgumentError):
    """A configuration file cannot be used. `path`, `stage` and `field` say where."""

    def __init__(
        self,
        path: str,
        message: str,
        *,
        stage: str | None = None,
        index: int | None = None,
        field_name: str | None = None,
    ) -> None:
        where = [path]
        if index is not None:
            where.append(f"stage {stage!r} (stages[{index}])" if stage else f"stages[{index}]")
        if field_name is not None:
            where.append(f"field {field_name!r}")
        super().__init__(": ".join([*where, message]))
        self.path, self.stage, self.index, self.field = path, stage, index, field_name


# ------------------------------------------------------------------ field types

_INT = "an integer"
_NUMBER = "a number"
_STR = "a string"
_TABLE = "a table"
_STR_LIST = "a list of strings"
_BOOL = "true or false"


def _toml_kind(hint: Any) -> str:
    """What TOML value a field annotated `hint` takes (None is written by leaving it out)."""
    if get_origin(hint) in (Union, UnionType):
        kinds = {_toml_kind(h) for h in get_args(hint) if h is not type(None)}
        assert len(kinds) == 1, f"a field of type {hint} takes {kinds} in TOML: pick one"
        return kinds.pop()
    origin = get_origin(hint) or hint
    if origin is bool:
        return _BOOL
    if origin is int:
        return _INT
    if origin is float:
        return _NUMBER
    if isinstance(origin, type) and issubclass(origin, str):  # str, and enums of str (AdmissionPolicy)
        return _STR
    if origin is tuple:
        return _STR_LIST
    if origin in (dict, Mapping) or dataclasses.is_dataclass(origin) or hasattr(origin, "__struct_fields__"):
        return _TABLE
    raise AssertionError(f"no TOML value for a field of type {hint}")


# StageSpec's fields and what TOML value each takes, from StageSpec's own annotations (a field
# is declared once, there); StageSpec itself checks the ranges.
_STAGE_HINTS = get_type_hints(StageSpec)
STAGE_FIELDS: dict[str, str] = {f.name: _toml_kind(_STAGE_HINTS[f.name]) for f in dataclasses.fields(StageSpec)}
# [stages.placement]: RayPlacement's fields a file can give (a PlacementGroup object cannot be
# written in TOML; a named one can).
PLACEMENT_FIELDS: dict[str, str] = {
    "num_cpus": _NUMBER,
    "num_gpus": _NUMBER,
    "resources": _TABLE,
    "strategy": _STR,
    "placement_group_name": _STR,
    "bundle_indices": _STR_LIST,
    "runtime_env": _TABLE,
}
# [stages.simulated_device]: a CPU stand-in for a GPU's capacity (a swap's memory gate).
SIMULATED_DEVICE_FIELDS: dict[str, str] = {"directory": _STR, "capacity_bytes": _INT}
assert set(SIMULATED_DEVICE_FIELDS) == set(SimulatedDevice.__struct_fields__), "update SIMULATED_DEVICE_FIELDS"

SERVER_FIELDS: dict[str, str] = {
    "host": _STR,
    "port": _INT,
    "default_stage": _STR,
    "api_key_file": _STR,
    "api_key_env": _STR,
    "public_health": _BOOL,
    "public_metrics": _BOOL,
    "max_body_bytes": _INT,
    "allowed_reload_sources": _STR_LIST,
    "idempotency_entries": _INT,
    "idempotency_bytes": _INT,
    "status_poll_interval_s": _NUMBER,
    "lifecycle_threads": _INT,
    "events_kept": _INT,
    "allowed_hosts": _STR_LIST,
    "allowed_origins": _STR_LIST,
    "read_timeout_s": _NUMBER,
    "keep_alive_s": _NUMBER,
    "max_connections": _INT,
}
ENGINE_FIELDS: dict[str, str] = {
    "transport": _STR,
    "host": _STR,
    "curve": _BOOL,
    "trace_path": _STR,
    "launcher": _STR,
    "ray_address": _STR,
    "ray_namespace": _STR,
}


def _type_ok(value: Any, expected: str) -> bool:
    if expected == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == _NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == _STR:
        return isinstance(value, str)
    if expected == _TABLE:
        return isinstance(value, dict)
    if expected == _BOOL:
        return isinstance(value, bool)
    if expected == _STR_LIST:  # devices may be written as integers (CUDA indices)
        return isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value)
    raise AssertionError(expected)


def _check_table(
    path: str,
    table: Mapping[str, Any],
    fields: Mapping[str, str],
    what: str,
    *,
    stage: str | None = None,
    index: int | None = None,
) -> None:
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(
                path,
                f"unknown field in {what}; known fields: {sorted(fields)}",
                stage=stage,
                index=index,
                field_name=key,
            )
        if not _type_ok(value, fields[key]):
            raise ConfigError(path, f"expected {fields[key]}, got {value!r}", stage=stage, index=index, field_name=key)


# ------------------------------------------------------------------ the parsed file


@dataclass(frozen=True)
class ServerConfig:
    """How `omni-core serve` listens and who may call it (README, "Serving over HTTP")."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    default_stage: str | None = None
    api_key_file: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    public_health: bool = True
    public_metrics: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Checkpoint directories a caller may name as a reload `source`; empty: none may be named.
    allowed_reload_sources: tuple[str, ...] = ()
    idempotency_entries: int = 4096
    idempotency_bytes: int = 64 << 20
    status_poll_interval_s: float = 0.5
    lifecycle_threads: int = 16
    events_kept: int = 200
    # Browser-facing checks (README, "Security by default"): Host names besides loopback and
    # the bind address, and page origins besides the server's own; "*" turns a check off.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # Connections: a request (headers and body) must arrive within read_timeout_s of its
    # first byte, or of the connection's opening; an idle keep-alive connection closes after
    # keep_alive_s (longer than clients' own expiry, httpx's 5 s, so the client closes first:
    # a request never goes out on a connection the server is closing at that moment, a lost
    # POST seen under load); max_connections 0: the descriptor limit less room for the ranks.
    read_timeout_s: float = 10.0
    keep_alive_s: float = 75.0
    max_connections: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be 0..65535, got {self.port}")
        if not 1 <= self.max_body_bytes <= MAX_BODY_BYTES_LIMIT:
            raise InvalidArgumentError(f"max_body_bytes must be 1..{MAX_BODY_BYTES_LIMIT}, got {self.max_body_bytes}")
        for what in ("idempotency_entries", "idempotency_bytes", "lifecycle_threads", "events_kept"):
            if getattr(self, what) < 1:
                raise InvalidArgumentError(f"{what} must be >= 1, got {getattr(self, what)}")
        for what in ("read_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, what) <= 3600:
                raise InvalidArgumentError(f"{what} must be in (0, 3600] s, got {getattr(self, what)}")
        if self.max_connections < 0:
            raise InvalidArgumentError(
                f"max_connections must be >= 0 (0: from the descriptor limit), got {self.max_connections}"
            )
        if not 0.05 <= self.status_poll_interval_s <= 60:
            raise InvalidArgumentError(
                f"status_poll_interval_s must be in [0.05, 60] s, got {self.status_poll_interval_s}"
            )


@dataclass(frozen=True)
class OmniConfig:
    stages: tuple[StageSpec, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: dict[str, Any] = field(default_factory=dict)  # Engine(...) keyword arguments
    path: str = "<config>"

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]


def _resolve_path(base: Path, value: str) -> str:
    """Paths in a config file are relative to the file, not to wherever the server starts."""
    return str((base / os.path.expanduser(value)).resolve())


def load_config(path: str | os.PathLike[str]) -> OmniConfig:
    """Read and check a TOML stage configuration; raises ConfigError naming what to fix."""
    shown = str(path)
    if tomllib is None:  # pragma: no cover - Python 3.10 without the serve extra
        raise ConfigError(shown, "reading TOML on Python 3.10 needs tomli: pip install 'omni-core[serve]'")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                shown, f"over {MAX_CONFIG_BYTES} bytes; a stage configuration is a few KiB: is this the right file?"
            )
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(shown, f"not UTF-8 text, so not TOML ({exc}); is this the right file?") from None
    except IsADirectoryError:
        raise ConfigError(shown, "is a directory; pass the path of a TOML stage configuration file") from None
    except FileNotFoundError:
        raise ConfigError(
            shown, "no such file; pass the path of a TOML stage configuration (examples/two_stages.toml is one)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(shown, f"not valid TOML: {exc}") from None
    return parse_config(data, shown, base=Path(path).resolve().parent)


def parse_config(data: Mapping[str, Any], path: str = "<config>", *, base: Path | None = None) -> OmniConfig:
    """Check an already-parsed configuration (a dict shaped like the TOML file)."""
    base = base or Path.cwd()
    for key in data:
        if key not in ("server", "engine", "stages"):
            raise ConfigError(
                path, f"unknown top-level key {key!r}; a config has [server], [engine] and [[stages]] tables"
            )
    for key in ("server", "engine"):
        if not isinstance(data.get(key, {}), dict):
            raise ConfigError(path, f"[{key}] must be a table, got {data[key]!r}")
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise ConfigError(path, "needs at least one [[stages]] table (name, runner, runner_args, ranks, ...)")
    stages: list[StageSpec] = []
    for index, raw in enumerate(raw_stages):
        stages.append(_parse_stage(path, index, raw, base))
    names = [s.name for s in stages]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ConfigError(
                path,
                f"duplicate stage name (also stages[{names.index(name)}]); names must be unique",
                stage=name,
                index=index,
                field_name="name",
            )
    server = _parse_server(path, data.get("server", {}), names, base)
    engine = dict(data.get("engine", {}))
    _check_table(path, engine, ENGINE_FIELDS, "[engine]")
    if "trace_path" in engine:
        engine["trace_path"] = _resolve_path(base, engine["trace_path"])
    return OmniConfig(stages=tuple(stages), server=server, engine=engine, path=path)


def _parse_stage(path: str, index: int, raw: Any, base: Path) -> StageSpec:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a [[stages]] table, got {raw!r}", index=index)
    name = raw.get("name")
    shown_name = name if isinstance(name, str) else None
    if name is None:
        raise ConfigError(path, "every stage needs a name", index=index, field_name="name")
    _check_table(path, raw, STAGE_FIELDS, "a stage", stage=shown_name, index=index)
    kwargs = dict(raw)
    for key in ("devices", "tags"):
        if key in kwargs:
            kwargs[key] = tuple(str(v) for v in kwargs[key])
    try:
        if "placement" in kwargs:
            _check_table(
                path, kwargs["placement"], PLACEMENT_FIELDS, "[stages.placement]", stage=shown_name, index=index
            )
            kwargs["placement"] = RayPlacement(**kwargs["placement"])
        if "simulated_device" in kwargs:
            kwargs["simulated_device"] = _simulated_device(path, kwargs["simulated_device"], base, shown_name, index)
        return StageSpec(**kwargs)
    except InvalidArgumentError as exc:
        # StageSpec names the field in its message; find which, so the error says it plainly.
        message = str(exc)
        named = next((f for f in sorted(STAGE_FIELDS, key=len, reverse=True) if f in message and f != "name"), None)
        if "stage name" in message:
            named = "name"
        raise ConfigError(path, message, stage=shown_name, index=index, field_name=named) from None


def _simulated_device(path: str, table: dict[str, Any], base: Path, stage: str | None, index: int) -> SimulatedDevice:
    what = "[stages.simulated_device]"
    _check_table(path, table, SIMULATED_DEVICE_FIELDS, what, stage=stage, index=index)
    missing = sorted(set(SIMULATED_DEVICE_FIELDS) - set(table))
    if missing:
        raise ConfigError(
            path,
            f"{what} needs {missing} (the shared directory and the capacity in bytes)",
            stage=stage,
            index=index,
            field_name="simulated_device",
        )
    try:
        return SimulatedDevice(_resolve_path(base, table["directory"]), table["capacity_bytes"])
    except ValueError as exc:
        raise ConfigError(path, str(exc), stage=stage, index=index, field_name="simulated_device") from None


def _parse_server(path: str, raw: Any, names: list[str], base: Path) -> ServerConfig:
    _check_table(path, raw, SERVER_FIELDS, "[server]")
    kwargs = dict(raw)
    default = kwargs.get("default_stage")
    if default is not None and default not in names:
        raise ConfigError(
            path, f"[server] default_stage {default!r} is not a stage; stages are {names}", field_name="default_stage"
        )
    if "api_key_file" in kwargs:
        kwargs["api_key_file"] = _resolve_path(base, kwargs["api_key_file"])
    for key in ("allowed_hosts", "allowed_origins"):
        if key in kwargs:
            kwargs[key] = tuple(str(v) for v in kwargs[key])
    if "allowed_reload_sources" in kwargs:
        kwargs["allowed_reload_sources"] = tuple(_resolve_path(base, str(p)) for p in kwargs["allowed_reload_sources"])
    try:
        return ServerConfig(**kwargs)
    except InvalidArgumentError as exc:
        named = next((f for f in SERVER_FIELDS if str(exc).startswith(f)), None)
        raise ConfigError(path, f"[server] {exc}", field_name=named) from None


# ------------------------------------------------------------------ omni-core demo --config

SYNTHETIC_PROBE = {"seed": 7, "batch": 2}


def run_config_demo(config: OmniConfig, out: Any = None) -> int:
    """`omni-core demo --config FILE`: start the file's stages and take each through a
    level-1 sleep and wake, then a level-2 sleep, wake and reload. Stages of the synthetic
    runner must answer a probe bit-identically after each; others are only cycled (their
    payloads are model-specific). Prints one line per step; non-zero exit on any mismatch."""
    import time

    from omni_core.engine import Engine

    out = out or sys.stdout
    failures: list[str] = []
    started = time.perf_counter()
    out.write(f"omni-core demo --config {config.path}: {len(config.stages)} stage(s)\n")
    with Engine(config.stages, **config.engine) as engine:
        out.write(f"started in {time.perf_counter() - started:.2f} s\n")
        for spec in config.stages:
            probe = spec.runner == "synthetic"
            reference = engine.execute(spec.name, SYNTHETIC_PROBE) if probe else None
            steps = [
                ("sleep L1", lambda n=spec.name: engine.sleep(n, level=1)),
                ("wake", lambda n=spec.name: engine.wake(n)),
                ("sleep L2", lambda n=spec.name: engine.sleep(n, level=2)),
                ("wake", lambda n=spec.name: engine.wake(n)),
                ("reload", lambda n=spec.name: engine.reload_weights(n)),
            ]
            for step, call in steps:
                report = call()
                freed_bytes = sum(r.freed_bytes for r in report.ranks.values())
                check = ""
                if probe and report.state == "RUNNING":
                    same = engine.execute(spec.name, SYNTHETIC_PROBE) == reference
                    check = "  output identical" if same else "  OUTPUT DIFFERS"
                    if not same:
                        failures.append(f"{spec.name}: output after {step} differs")
                out.write(
                    f"{spec.name:<16} {step:<9} -> {report.state:<13} {report.duration_s * 1000:8.1f} ms  "
                    f"freed {freed_bytes:>12} B{check}\n"
                )
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    out.write(f"verdict: {verdict} ({time.perf_counter() - started:.1f} s)\n")
    return 0 if not failures else 1
