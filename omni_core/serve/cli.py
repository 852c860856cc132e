"""`omni-core serve` and the client verbs `omni-core status|sleep|wake --url URL`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_core.client import OmniClient, ServeError
from omni_core.units import fmt_bytes


def run_serve(args: argparse.Namespace) -> int:
    if args.write_openapi:
        from omni_core.serve.openapi import write_openapi

        print(f"wrote {write_openapi(args.write_openapi)}")
        return 0
    if not args.config:
        print(
            "omni-core serve: --config FILE is required (a TOML stage config; examples/two_stages.toml is one)",
            file=sys.stderr,
        )
        return 2
    from omni_core.config import ConfigError, load_config
    from omni_core.serve.server import serve, with_overrides

    try:
        config = with_overrides(
            load_config(args.config),
            host=args.host,
            port=args.port,
            api_key_file=args.api_key_file,
            default_stage=args.default_stage,
            allowed_hosts=_tuple(args.allowed_host),
            allowed_origins=_tuple(args.allowed_origin),
            access_log=args.access_log,
        )
        if config.server.default_stage is not None and config.server.default_stage not in config.stage_names:
            raise ConfigError(
                args.config,
                f"--default-stage {config.server.default_stage!r} is not a stage; stages are {config.stage_names}",
            )
    except (ConfigError, ValueError) as exc:
        print(f"omni-core serve: {exc}", file=sys.stderr)
        return 2
    return serve(config, log_level=args.log_level, log_json=args.log_json)


def _tuple(values: list[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values else None


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def _print_stages(stages: list[dict[str, Any]]) -> None:
    print(f"{'id':<3} {'stage':<16} {'state':<14} {'epoch':>5} {'queued':>6} {'in flight':>9}  ranks")
    for st in stages:
        ranks = ", ".join(
            f"r{rank}: {r['state']} pid {r['pid']}" + ("" if r["alive"] else " (gone)")
            for rank, r in st["ranks"].items()
        )
        print(
            f"{st['stage_id']:<3} {st['name']:<16} {st['state']:<14} {st['epoch']:>5} {st['queued']:>6} "
            f"{st['in_flight']:>9}  {ranks}"
        )
        if st.get("failure"):
            print(f"    failure: {st['failure']}")


def _print_report(report: dict[str, Any]) -> None:
    freed = sum(r["freed_bytes"] for r in report["ranks"].values())
    restored = sum(r.get("restored_bytes", 0) for r in report["ranks"].values())
    status = "" if report["status"] == "OK" else f" ({report['status']})"
    moved = f"restored {_fmt_bytes(restored)}" if restored > freed else f"freed {_fmt_bytes(freed)}"
    print(
        f"{report['stage']}: {report['command']} -> {report['state']}{status} in "
        f"{report['duration_s'] * 1000:.1f} ms, {moved} over {len(report['ranks'])} rank(s)"
    )


def run_remote(args: argparse.Namespace) -> int:
    verb = args.verb
    try:
        client = OmniClient(args.url, api_key_file=args.api_key_file)
        if verb == "status":
            answer: Any = [client.stage(args.stage)] if args.stage else client.stages()
        elif verb == "sleep":
            answer = client.sleep(
                args.stage,
                args.level,
                args.tags,
                timeout_s=args.timeout_s,
                abort_in_flight=args.abort_in_flight,
                idempotency_key=args.idempotency_key,
            )
        elif verb == "swap":
            answer = client.swap(
                args.out_stage,
                args.in_stage,
                level=args.level,
                tags=args.tags,
                memory_wait_s=args.memory_wait_s,
                timeout_s=args.timeout_s,
                idempotency_key=args.idempotency_key,
            )
        else:
            answer = client.wake(args.stage, args.tags, timeout_s=args.timeout_s, idempotency_key=args.idempotency_key)
    except ServeError as exc:
        print(f"omni-core {verb}: HTTP {exc.status} {exc.type}: {exc}", file=sys.stderr)
        for line in _error_lines(exc.body.get("error") or {}):
            print(f"  {line}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omni-core {verb}: cannot read the API key file: {exc}", file=sys.stderr)
        return 2
    say_if_replayed(verb, answer, getattr(args, "idempotency_key", None))  # status takes no key
    if args.json:
        print(json.dumps(answer, indent=2))
    elif verb == "status":
        _print_stages(answer)
    elif verb == "swap":
        for half in ("outgoing", "incoming"):
            _print_report(answer[half])
        print(f"swap {answer['task_id']}: both halves done in {answer['duration_s'] * 1000:.1f} ms")
    else:
        _print_report(answer)
    return 0


def say_if_replayed(verb: str, answer: Any, key: str | None) -> None:
    """A client verb's answer that the server took from its Idempotency-Key record says so."""
    if getattr(answer, "replayed", False):
        print(
            f"omni-core {verb}: replayed: this is the answer to the first request with Idempotency-Key "
            f"{key!r}; nothing ran again, and the stage may have changed since (omni-core status shows it "
            "now)",
            file=sys.stderr,
        )


def _error_lines(error: dict[str, Any]) -> list[str]:
    """What an error body says beyond its message: each rank's NO_MEMORY refusal (who holds
    the device), and a failed swap's two halves, each its state or its error."""
    lines = [f"rank {rank}: {why}" for rank, why in (error.get("refusals") or {}).items()]
    for name in ("outgoing", "incoming"):
        half = error.get(name)
        if not half:
            continue
        if half.get("report"):
            report = half["report"]
            lines.append(f"{name} {half['stage']}: {report['command']} -> {report['state']} ({report['status']})")
        elif half.get("error"):
            lines.append(f"{name} {half['stage']}: {half['error'].get('type')}: {half['error'].get('message')}")
            lines += [f"  {line}" for line in _error_lines(half["error"])]
    return lines
