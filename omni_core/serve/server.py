"""Starting and stopping `omni-core serve`: checks first, then the engine, then uvicorn."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import uvicorn

from omni_core.config import OmniConfig
from omni_core.engine import Engine
from omni_core.engine.errors import InvalidArgumentError, StageFailedError
from omni_core.engine.rendezvous import DEFAULT_WEIGHT_GROUP_HOSTS, RendezvousPolicy
from omni_core.serve.app import create_app
from omni_core.serve.auth import ServeRefusedError, check_bind, load_api_key
from omni_core.serve.connections import ConnectionGuard, connection_limit, guarded_protocol, install_log_limits
from omni_core.serve.logs import EVENT_ATTR
from omni_core.serve.logs import configured as logs_configured
from omni_core.serve.start_errors import start_failure

log = logging.getLogger("omni_core.serve")
LISTEN_BACKLOG = 2048  # uvicorn's default
GRACEFUL_SHUTDOWN_S = 5  # open event streams and calls get this long after SIGINT/SIGTERM (uvicorn: an int)
STARTUP_WAIT_S = 60.0


class _Server(uvicorn.Server):
    """uvicorn's server, ending the app's event streams as soon as shutdown begins (they
    would otherwise hold their connections until the graceful timeout)."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app
        self.signalled = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signalled = True
        self._app.state.serve.begin_close()
        super().handle_exit(sig, frame)


def uvicorn_config(
    app: Any, host: str, port: int, log_level: str = "info", log_config: Any = uvicorn.config.LOGGING_CONFIG
) -> uvicorn.Config:
    """uvicorn's settings for `app`, with the connection guard of its [server] config.
    `log_config=None`: uvicorn leaves its loggers to the caller's handlers."""
    state = app.state.serve
    server_cfg = state.server
    ranks = sum(spec.ranks for spec in state.config.stages)
    limit = connection_limit(server_cfg.max_connections, ranks)
    guard = ConnectionGuard(
        server_cfg.read_timeout_s,
        limit,
        on_closed=lambda reason: state.metrics.http_connections_closed.labels(reason).inc(),
        on_count=state.metrics.http_connections_open.set,
        max_per_client=min(limit, server_cfg.max_connections_per_client or max(1, limit // 2)),
        key_accepts=state.key_check.accepts if state.key_check.enabled else None,
    )
    install_log_limits()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=server_cfg.keep_alive_s,
        server_header=False,
        http=guarded_protocol(guard),
    )


def with_overrides(config: OmniConfig, **overrides: Any) -> OmniConfig:
    """The config with command-line overrides of [server] (those that are not None)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(config, server=msgspec.structs.replace(config.server, **given)) if given else config


def serve(
    config: OmniConfig, *, log_level: str = "info", log_json: bool = False, environ: dict[str, str] | None = None
) -> int:
    """Run until SIGINT/SIGTERM. Refuses to start (exit 2) on an unsafe or broken setup, and
    on an address it cannot listen on: the socket is bound before any rank starts."""
    with logs_configured(json_lines=log_json, level=log_level):
        return _serve(config, log_level, environ)


def _serve(config: OmniConfig, log_level: str, environ: dict[str, str] | None) -> int:
    server_cfg = config.server
    try:
        api_key = load_api_key(server_cfg, os.environ if environ is None else environ)
        rendezvous = RendezvousPolicy(config.engine.get("allowed_weight_group_hosts", DEFAULT_WEIGHT_GROUP_HOSTS))
        check_bind(server_cfg.host, api_key, rendezvous.beyond_loopback())
        listener = bind_listener(server_cfg.host, server_cfg.port)
    except (ServeRefusedError, InvalidArgumentError) as exc:
        log.error("%s", exc, extra={EVENT_ATTR: {"event": "refused"}})
        return 2
    url = f"http://{_url_host(server_cfg.host)}:{listener.getsockname()[1]}/"
    names = ", ".join(f"{s.name} ({s.ranks} rank{'s' if s.ranks > 1 else ''})" for s in config.stages)
    log.info(
        "starting %s from %s",
        names,
        config.path,
        extra={EVENT_ATTR: {"event": "starting", "config": str(config.path), "stages": config.stage_names}},
    )
    try:
        engine = Engine(config.stages, **config.engine)
    except StageFailedError as exc:  # a config mistake the ranks found: one line, not a traceback
        listener.close()
        log.error("%s", start_failure(exc, config), extra={EVENT_ATTR: {"event": "start_failed", "stage": exc.stage}})
        return 2
    except BaseException:
        listener.close()
        raise
    server: _Server | None = None
    try:
        app = create_app(engine, config, api_key=api_key)
        server = _Server(uvicorn_config(app, server_cfg.host, server_cfg.port, log_level, log_config=None), app)
        auth = "API key required on control routes" if api_key else "no API key (loopback only)"
        log.info(
            "listening on %s (%s); Ctrl-C stops it", url, auth, extra={EVENT_ATTR: {"event": "listening", "url": url}}
        )
        # uvicorn re-raises the signal that stopped it once it is done; SIGTERM's default
        # action would end the process before the engine below could stop its ranks.
        previous = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            server.run(sockets=[listener])
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        listener.close()
        log.info("stopping the engine's ranks", extra={EVENT_ATTR: {"event": "stopping"}})
        engine.shutdown()
    if server is not None and not server.started and not server.signalled:
        log.error(
            "the HTTP server did not start (its error is logged above); nothing was served",
            extra={EVENT_ATTR: {"event": "failed_to_start"}},
        )
        return 1
    log.info("stopped", extra={EVENT_ATTR: {"event": "stopped"}})
    return 0


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts: a port in use ends `serve`
    in a line, not after every rank has loaded its weights."""
    address = f"{_url_host(host)}:{port}"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ServeRefusedError(
            f"cannot listen on {address}: the host {host!r} does not resolve ({exc}); "
            "pass --host with an address of this machine"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait
        if family == socket.AF_INET6:  # as asyncio's own listener: "::" is IPv6 only, not IPv4 too
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            why = (
                f"cannot listen on {address}: the address is already in use (another `omni-core serve` or "
                f"another program holds it; `ss -ltnp 'sport = :{port}'` names it); pass another --port "
                "(or set [server] port), or stop the other process"
            )
        elif exc.errno == errno.EACCES:
            why = (
                f"cannot listen on {address}: permission denied (ports below 1024 need privileges); "
                "pass a --port of 1024 or above"
            )
        else:
            why = f"cannot listen on {address}: {exc.strerror or exc}; pass a --host that is an address of this machine"
        raise ServeRefusedError(why) from None
    return sock


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass
class RunningServer:
    url: str
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout_s: float = 30.0) -> None:
        self.app.state.serve.begin_close()
        self.server.should_exit = True
        self.thread.join(timeout_s)


@contextlib.contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> Iterator[RunningServer]:
    """Run `app` on a real socket in a background thread (tests, embedding). Port 0: any
    free port; the URL says which."""
    server = _Server(uvicorn_config(app, host, port, log_level), app)
    thread = threading.Thread(target=server.run, name="omni-core-serve", daemon=True)
    thread.start()
    started = threading.Event()
    for _ in range(int(STARTUP_WAIT_S / 0.01)):
        if server.started or not thread.is_alive():
            started.set()
            break
        threading.Event().wait(0.01)
    if not server.started:
        server.should_exit = True
        raise RuntimeError(f"the HTTP server did not start within {STARTUP_WAIT_S} s (see its log above)")
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningServer(f"http://{_url_host(host)}:{bound_port}", app, server, thread)
    try:
        yield running
    finally:
        running.stop()
