"""`omni-core adapters list|add|remove|pin STAGE ...`: a running `omni-core serve`'s LoRA
adapters (P-20) over its `/v1/stages/{name}/adapters` routes, printed as the other client
verbs print a report (`--json`: the server's answer)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from omni_core.client import OmniClient, ServeError

ACTIONS = {
    "list": "every adapter of every rank: loaded, gone (a level-2 sleep discarded it) or stale",
    "add": "load adapter NAME from SOURCE, a PEFT directory under allowed_reload_sources",
    "remove": "unload adapter NAME (not loaded: ALREADY)",
    "pin": "pin adapter NAME (never evicted); --unpin unpins",
}


def add_adapter_arguments(p: argparse.ArgumentParser) -> None:
    from omni_core.serve.cli_args import DEFAULT_URL, URL_ENV

    p.add_argument("action", choices=sorted(ACTIONS), help="; ".join(f"{k}: {v}" for k, v in ACTIONS.items()))
    p.add_argument("stage", help="stage name")
    p.add_argument("name", nargs="?", help="the adapter (add, remove, pin)")
    p.add_argument("source", nargs="?", help="add: a PEFT directory under the server's allowed_reload_sources")
    p.add_argument(
        "--url", default=os.environ.get(URL_ENV, DEFAULT_URL), help=f"default ${URL_ENV}, else {DEFAULT_URL}"
    )
    p.add_argument("--api-key-file", default=None, help="file holding the API key (else OMNI_CORE_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--idempotency-key", default=None, help="a retry with the same key has no second effect")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of the command (server side)")
    p.add_argument("--rank", type=int, default=None, help="add: the LoRA rank (default adapter_config.json's r)")
    p.add_argument("--target-modules", default=None, help="add: comma-separated (default adapter_config.json's)")
    p.add_argument("--version", type=int, default=1, dest="adapter_version", help="add: the adapter's version")
    p.add_argument("--base-version", type=int, default=None, help="add: the base weights version it was made for")
    p.add_argument("--pinned", action="store_true", help="add: pinned from the start (never evicted)")
    p.add_argument("--rebind", action="store_true", help="add: serve it on the weights held, whatever its base")
    p.add_argument("--unpin", action="store_true", help="pin: unpin instead")


def _call(client: OmniClient, args: argparse.Namespace) -> Any:
    key, limit = args.idempotency_key, args.timeout_s
    if args.action == "list":
        return client.list_adapters(args.stage, idempotency_key=key)
    if args.action == "add":
        modules = None if args.target_modules is None else [m for m in args.target_modules.split(",") if m]
        return client.add_adapter(
            args.stage,
            args.name,
            args.source,
            rank=args.rank,
            target_modules=modules,
            version=args.adapter_version,
            base_version=args.base_version,
            pinned=args.pinned,
            rebind=args.rebind,
            timeout_s=limit,
            idempotency_key=key,
        )
    if args.action == "remove":
        return client.remove_adapter(args.stage, args.name, timeout_s=limit, idempotency_key=key)
    return client.pin_adapter(args.stage, args.name, not args.unpin, timeout_s=limit, idempotency_key=key)


def _missing(args: argparse.Namespace) -> str | None:
    if args.action != "list" and not args.name:
        return f"omni-core adapters {args.action}: NAME is required (omni-core adapters {args.action} STAGE NAME)"
    if args.action == "add" and not args.source:
        return "omni-core adapters add: SOURCE is required (omni-core adapters add STAGE NAME DIR)"
    return None


def adapter_lines(answer: dict[str, Any]) -> list[str]:
    """The report's header and rank 0's adapters, one line each."""
    lines = [f"{answer['stage']}: {answer['command']} -> {answer['state']} ({answer['status']})"]
    ranks = answer.get("ranks") or {}
    listed = ranks[min(ranks, key=int)].get("adapters", []) if ranks else []
    evicted = [n for r in ranks.values() for n in r.get("adapters_evicted", [])]
    for a in listed:
        pin = " pinned" if a.get("pinned") else ""
        lines.append(f"  {a['name']} v{a['version']} on base v{a['base_version']} rank {a['rank']}: {a['status']}{pin}")
    if not listed:
        lines.append("  no adapters")
    if evicted:
        lines.append(f"  evicted (least recently used): {sorted(set(evicted))}")
    return lines


def run_adapters(args: argparse.Namespace) -> int:
    problem = _missing(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        answer = _call(OmniClient(args.url, api_key_file=args.api_key_file), args)
    except ServeError as exc:
        print(f"omni-core adapters {args.action}: HTTP {exc.status} {exc.type}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omni-core adapters {args.action}: cannot read the API key file: {exc}", file=sys.stderr)
        return 2
    from omni_core.serve.cli import say_if_replayed

    say_if_replayed(f"adapters {args.action}", answer, args.idempotency_key)
    print(json.dumps(answer, indent=2) if args.json else "\n".join(adapter_lines(answer)))
    return 0
