"""API keys and where the server may listen.

A key comes from a file (`api_key_file`, `--api-key-file`) or an environment variable
(`api_key_env`, default OMNI_CORE_API_KEY), never from the command line: argv is readable
by every user of the host (`ps`, /proc/*/cmdline) and lands in shell history.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import stat
from collections.abc import Mapping

from omni_core.config import MIN_API_KEY_CHARS, ServerConfig

log = logging.getLogger("omni_core.serve")


class ServeRefusedError(RuntimeError):
    """The server will not start as configured; the message says what to change."""


def load_api_key(server: ServerConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The key from the file if one is configured, else from the environment, else None."""
    environ = os.environ if environ is None else environ
    if server.api_key_file:
        try:
            with open(server.api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
            mode = os.stat(server.api_key_file).st_mode
        except OSError as exc:
            raise ServeRefusedError(
                f"cannot read api_key_file {server.api_key_file!r}: {exc}; "
                "create it with the key on one line (chmod 600)"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("api_key_file %s is readable by other users; chmod 600 it", server.api_key_file)
        source = f"api_key_file {server.api_key_file!r}"
    else:
        key = environ.get(server.api_key_env, "").strip()
        if not key:
            return None
        source = f"environment variable {server.api_key_env}"
    if len(key) < MIN_API_KEY_CHARS:
        raise ServeRefusedError(
            f"the API key in {source} has {len(key)} characters; use at least "
            f"{MIN_API_KEY_CHARS}, e.g. from "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine. Names other than
    'localhost' are not resolved: a name can point anywhere, so it counts as not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


KEY_HOW = (
    "Put a key in a file and pass --api-key-file FILE (or set api_key_file in [server], or the "
    "OMNI_CORE_API_KEY environment variable)"
)


def check_bind(host: str, api_key: str | None, weight_group_hosts: list[str] | None = None) -> None:
    """Refuse to listen beyond loopback without a key: every control route would be open
    to whoever reaches the port (vLLM's /sleep and /collective_rpc are, in dev mode). And
    refuse a weight-group allow list that reaches beyond this host without a key: any local
    user could then make the ranks connect there (`weight_group_hosts`: those entries)."""
    if api_key is None and not is_loopback(host):
        raise ServeRefusedError(
            f"refusing to listen on {host!r} without an API key: anyone who reaches it could sleep, "
            f"restart or reload your stages. {KEY_HOW}, or listen on 127.0.0.1"
        )
    if api_key is None and weight_group_hosts:
        raise ServeRefusedError(
            f"refusing to serve the weight-group routes without an API key while [engine] "
            f"allowed_weight_group_hosts reaches beyond this host ({weight_group_hosts[:5]}): any local user "
            f"could make the ranks connect there. {KEY_HOW}, or keep allowed_weight_group_hosts to loopback"
        )


class KeyCheck:
    """Compares a presented key with the server's in constant time. Both sides are hashed
    first, so neither the content nor the length of the key leaks through timing."""

    def __init__(self, key: str | None) -> None:
        self._digest = hashlib.sha256(key.encode()).digest() if key is not None else None

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def accepts(self, authorization: str | None) -> bool:
        if self._digest is None:
            return True
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            # Still run the comparison so a missing header costs the same time as a wrong one.
            presented = ""
        return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), self._digest)
