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

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.fields import conform, validation_words
from omni_core.engine.pipeline import PipelineRoute
from omni_core.engine.spec import StageSpec

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


# ------------------------------------------------------------------ the parsed file

# A connection's timeouts: an hour at most (a deadline of a command may be 24 h: workers.config).
MAX_CONNECTION_TIMEOUT_S = 3600.0
ConnectionSeconds = Annotated[float, Meta(gt=0, le=MAX_CONNECTION_TIMEOUT_S)]
AtLeastOne = Annotated[int, Meta(ge=1)]


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How `omni-core serve` listens and who may call it (README, "Serving over HTTP")."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = DEFAULT_PORT
    default_stage: str | None = None
    api_key_file: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    public_health: bool = True
    public_metrics: bool = True
    max_body_bytes: Annotated[int, Meta(ge=1, le=MAX_BODY_BYTES_LIMIT)] = DEFAULT_MAX_BODY_BYTES
    # Checkpoint directories a caller may name as a reload `source`; empty: none may be named.
    allowed_reload_sources: tuple[str, ...] = ()
    idempotency_entries: AtLeastOne = 4096
    idempotency_bytes: AtLeastOne = 64 << 20
    status_poll_interval_s: Annotated[float, Meta(ge=0.05, le=60)] = 0.5
    lifecycle_threads: AtLeastOne = 16
    events_kept: AtLeastOne = 200
    # Browser-facing checks (README, "Security by default"): Host names besides loopback and
    # the bind address, and page origins besides the server's own; "*" turns a check off.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # Connections: a request (headers and body) must arrive within read_timeout_s of its
    # first byte, or of the connection's opening; an idle keep-alive connection closes after
    # keep_alive_s (longer than clients' own expiry, httpx's 5 s, so the client closes first:
    # a request never goes out on a connection the server is closing at that moment, a lost
    # POST seen under load); max_connections 0: the descriptor limit less room for the ranks;
    # max_connections_per_client (one peer address) 0: half of max_connections.
    read_timeout_s: ConnectionSeconds = 10.0
    keep_alive_s: ConnectionSeconds = 75.0
    max_connections: Annotated[int, Meta(ge=0)] = 0
    max_connections_per_client: Annotated[int, Meta(ge=0)] = 0
    # One log line per HTTP answer (serve/access_log.py; `--access-log`), within a line budget.
    access_log: bool = False

    def __post_init__(self) -> None:
        conform(self, "[server]")


class EngineTable(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """[engine]: the keyword arguments of `Engine(...)` a file can write (a RankLauncher object
    cannot be; its name can). Keys the file leaves out keep Engine's defaults."""

    transport: str | msgspec.UnsetType = msgspec.UNSET
    host: str | msgspec.UnsetType = msgspec.UNSET
    curve: bool | msgspec.UnsetType = msgspec.UNSET
    trace_path: str | msgspec.UnsetType = msgspec.UNSET
    launcher: str | msgspec.UnsetType = msgspec.UNSET
    ray_address: str | msgspec.UnsetType = msgspec.UNSET
    ray_namespace: str | msgspec.UnsetType = msgspec.UNSET
    # Where a weight group's rendezvous may take the ranks (engine/rendezvous.py); unset: loopback.
    allowed_weight_group_hosts: tuple[str, ...] | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not msgspec.UNSET}


@dataclass(frozen=True)
class OmniConfig:
    stages: tuple[StageSpec, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: dict[str, Any] = field(default_factory=dict)  # Engine(...) keyword arguments
    path: str = "<config>"
    pipelines: tuple[PipelineRoute, ...] = ()  # [[pipelines]]: requests across stages (P-22)

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
        if key not in ("server", "engine", "stages", "pipelines"):
            raise ConfigError(
                path,
                f"unknown top-level key {key!r}; a config has [server], [engine], [[stages]] and [[pipelines]] tables",
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
    engine = _decode(path, "[engine]", dict(data.get("engine", {})), EngineTable).given()
    if "trace_path" in engine:
        engine["trace_path"] = _resolve_path(base, engine["trace_path"])
    pipelines = _parse_pipelines(path, data.get("pipelines", []), names)
    return OmniConfig(stages=tuple(stages), server=server, engine=engine, path=path, pipelines=pipelines)


def _parse_pipelines(path: str, raw: Any, names: list[str]) -> tuple[PipelineRoute, ...]:
    """Each [[pipelines]] table decoded into PipelineRoute, its stages among the config's."""
    if not isinstance(raw, list):
        raise ConfigError(path, f"[[pipelines]] must be an array of tables, got {raw!r:.80}")
    routes = []
    for index, table in enumerate(raw):
        if not isinstance(table, dict):
            raise ConfigError(path, f"pipelines[{index}] must be a table, got {table!r:.80}")
        route = _decode(path, f"pipelines[{index}]", table, PipelineRoute)
        unknown = [hop.stage for hop in route.stages if hop.stage not in names]
        if unknown:
            raise ConfigError(path, f"pipelines[{index}] ({route.name!r}) names stages {unknown}; stages are {names}")
        routes.append(route)
    return tuple(routes)


def _parse_stage(path: str, index: int, raw: Any, base: Path) -> StageSpec:
    """One [[stages]] table decoded into StageSpec, whose declarations check every field."""
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a [[stages]] table, got {raw!r}", index=index)
    name = raw.get("name")
    placement = raw.get("placement")
    if isinstance(placement, dict) and "placement_group" in placement:
        raise ConfigError(
            path,
            "takes a PlacementGroup object, which Python can pass and a file cannot; "
            "name the group with placement_group_name",
            stage=name if isinstance(name, str) else None,
            index=index,
            field_name="placement.placement_group",
        )
    table = dict(raw)
    device = table.get("simulated_device")
    if isinstance(device, dict) and isinstance(device.get("directory"), str):
        table["simulated_device"] = dict(device, directory=_resolve_path(base, device["directory"]))
    return _decode(path, None, table, StageSpec, shown=raw, stage=name if isinstance(name, str) else None, index=index)


T = TypeVar("T")


def _decode(
    path: str,
    section: str | None,
    table: dict[str, Any],
    cls: type[T],
    *,
    shown: Mapping[str, Any] | None = None,
    stage: str | None = None,
    index: int | None = None,
) -> T:
    """`table` decoded into `cls`, whose declarations check every field; a refusal names the
    key, the bound and the value the file gave (`shown`: the table as written)."""
    try:
        return msgspec.convert(table, cls)
    except msgspec.ValidationError as exc:
        detail, field_path = validation_words(exc, cls)
        message = _with_value(detail, table if shown is None else shown, field_path)
        raise ConfigError(
            path, f"{section} {message}" if section else message, stage=stage, index=index, field_name=field_path
        ) from None


_ABSENT = object()


def _with_value(detail: str, table: Mapping[str, Any], field_path: str | None) -> str:
    """`detail` ending in the value the file gave (in place of msgspec's name of its type)."""
    if field_path is None or not detail.startswith(("expected", "must be one of")):  # words without the value
        return detail
    value: Any = table
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", field_path):
        if part.startswith("["):
            at = int(part[1:-1])
            value = value[at] if isinstance(value, list) and at < len(value) else _ABSENT
        else:
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
    if value is _ABSENT:
        return detail
    return f"{detail.split(', got ')[0]}, got {value!r}"


def _parse_server(path: str, raw: dict[str, Any], names: list[str], base: Path) -> ServerConfig:
    table = dict(raw)
    default = table.get("default_stage")
    if default is not None and default not in names:
        raise ConfigError(
            path, f"[server] default_stage {default!r} is not a stage; stages are {names}", field_name="default_stage"
        )
    if isinstance(table.get("api_key_file"), str):
        table["api_key_file"] = _resolve_path(base, table["api_key_file"])
    sources = table.get("allowed_reload_sources")
    if isinstance(sources, list) and all(isinstance(p, str) for p in sources):
        table["allowed_reload_sources"] = [_resolve_path(base, p) for p in sources]
    return _decode(path, "[server]", table, ServerConfig, shown=raw)


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
                restored_bytes = sum(r.restored_bytes for r in report.ranks.values())
                check = ""
                if probe and report.state == "RUNNING":
                    same = engine.execute(spec.name, SYNTHETIC_PROBE) == reference
                    check = "  output identical" if same else "  OUTPUT DIFFERS"
                    if not same:
                        failures.append(f"{spec.name}: output after {step} differs")
                out.write(
                    f"{spec.name:<16} {step:<9} -> {report.state:<13} {report.duration_s * 1000:8.1f} ms  "
                    f"freed {freed_bytes:>12} B  restored {restored_bytes:>12} B{check}\n"
                )
    verdict = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    out.write(f"verdict: {verdict} ({time.perf_counter() - started:.1f} s)\n")
    return 0 if not failures else 1
