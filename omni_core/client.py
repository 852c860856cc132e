"""A small Python client for `omni-core serve` (standard library only, so an RL controller
can drive stages without installing the server's dependencies).

```python
from omni_core.client import OmniClient

client = OmniClient("http://127.0.0.1:8000", api_key=None)   # or api_key_file=..., or OMNI_CORE_API_KEY
client.sleep("talker", level=1)                 # -> the LifecycleReport as a dict
client.wake("talker", idempotency_key="wake-7") # a retry with the same key has no second effect
client.swap("talker", "decoder")                 # talker sleeps while decoder wakes, both at once
client.execute("talker", {"seed": 1, "batch": 2})
client.stages()                                  # state, epoch, ranks, memory of every stage
```

A JSON object answer is a `Reply`, a dict whose `replayed` is True when the server answered
a retried `Idempotency-Key` from its record (its `Idempotent-Replayed` header): nothing ran
again, and the stage may have moved on since. Use a fresh key per intent; reuse one only to
retry the same call. Bodies carry only the fields given (no nulls), so a call and the same
call sent with curl are one request under one key.

An error answer raises `ServeError` with the server's status code, error type and the
engine's own message (`exc.status`, `exc.type`, `str(exc)`).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from typing import Any

DEFAULT_TIMEOUT_S = 120.0  # above the default lifecycle deadline (30 s) plus its drain
API_KEY_ENV = "OMNI_CORE_API_KEY"


class Reply(dict):
    """The server's JSON object; `replayed`: answered from the Idempotency-Key record."""

    replayed: bool = False


class ServeError(Exception):
    """The server answered with an error; `status` is its HTTP code, `type` the error type."""

    def __init__(self, status: int, kind: str, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = kind
        self.body = body or {}


def read_api_key(api_key_file: str | None = None, environ: dict[str, str] | None = None) -> str | None:
    """A key from a file, else from OMNI_CORE_API_KEY; None when neither is set."""
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as f:
            return f.read().strip()
    value = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    return value or None


class OmniClient:
    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        api_key_file: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else read_api_key(api_key_file)
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ omni-core's routes

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def stages(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/stages")["stages"]

    def stage(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/stages/{_seg(name)}")

    def sleep(
        self,
        stage: str,
        level: int = 1,
        tags: Iterable[str] | None = None,
        *,
        timeout_s: float | None = None,
        abort_in_flight: bool = False,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        body = {"level": level, "tags": _list(tags), "timeout_s": timeout_s, "abort_in_flight": abort_in_flight or None}
        return self._call("POST", f"/v1/stages/{_seg(stage)}/sleep", body, idempotency_key)

    def wake(
        self,
        stage: str,
        tags: Iterable[str] | None = None,
        *,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        return self._call(
            "POST", f"/v1/stages/{_seg(stage)}/wake", {"tags": _list(tags), "timeout_s": timeout_s}, idempotency_key
        )

    def swap(
        self,
        out_stage: str,
        in_stage: str,
        *,
        level: int = 1,
        tags: Iterable[str] | None = None,
        memory_wait_s: float | None = None,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """`out_stage` sleeps while `in_stage` wakes (POST /v1/swap): {task_id, duration_s,
        outgoing, incoming}. A swap that does not complete raises `ServeError` whose `body`
        holds both halves (`body["error"]["outgoing"]`, `["incoming"]`)."""
        body = {
            "out": out_stage,
            "in": in_stage,
            "level": level,
            "tags": _list(tags),
            "memory_wait_s": memory_wait_s,
            "timeout_s": timeout_s,
        }
        return self._call("POST", "/v1/swap", body, idempotency_key)

    def reload_weights(
        self,
        stage: str,
        source: str | None = None,
        *,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        return self._call(
            "POST", f"/v1/stages/{_seg(stage)}/reload", {"source": source, "timeout_s": timeout_s}, idempotency_key
        )

    def update_weights(
        self,
        stage: str,
        source: str | dict[str, Any],
        *,
        version: int,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """New weights as `version` (above the stage's): a checkpoint path, or a typed source
        (`msgspec.to_builtins` of what `WeightSender` shares)."""
        return self._call(
            "POST",
            f"/v1/stages/{_seg(stage)}/update_weights",
            {"version": version, "source": source, "timeout_s": timeout_s},
            idempotency_key,
        )

    def save_weights(
        self,
        stage: str,
        directory: str,
        *,
        overwrite: bool = False,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Every rank writes the weights it holds, at the stage's version, to `directory` (under
        the server's allowed_reload_sources); a restart then comes back at that version."""
        body = {"directory": directory, "overwrite": overwrite, "timeout_s": timeout_s}
        return self._call("POST", f"/v1/stages/{_seg(stage)}/save_weights", body, idempotency_key)

    def pause(
        self, stage: str, mode: str = "wait", *, timeout_s: float | None = None, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Close the stage's admission keeping its memory (PAUSED once no request is in flight)."""
        body = {"mode": mode, "timeout_s": timeout_s}
        return self._call("POST", f"/v1/stages/{_seg(stage)}/pause", body, idempotency_key)

    def resume(
        self, stage: str, *, timeout_s: float | None = None, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        return self._call("POST", f"/v1/stages/{_seg(stage)}/resume", {"timeout_s": timeout_s}, idempotency_key)

    def restart(
        self, stage: str, *, from_checkpoint: bool = False, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """The answer names the version the stage came back at (`weights_version`), a
        `version_floor` when that version lived in memory only, and `version_reset_from`
        after `from_checkpoint=True`."""
        body = {"from_checkpoint": from_checkpoint}
        return self._call("POST", f"/v1/stages/{_seg(stage)}/restart", body, idempotency_key)

    def set_admission(self, stage: str, policy: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/stages/{_seg(stage)}/admission", {"policy": policy})

    def execute(
        self,
        stage: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
        with_version: bool = False,
    ) -> Any:
        """Rank 0's output (bytes arrive as base64 strings); with `with_version`, the whole
        answer: `output`, `weights_version` (the weights that produced it) and `stage`."""
        body = {"payload": payload, "timeout_s": timeout_s}
        answer = self._call("POST", f"/v1/stages/{_seg(stage)}/execute", body, idempotency_key)
        return answer if with_version else answer["output"]

    # ------------------------------------------------------------------ LoRA adapters (P-20)

    def list_adapters(self, stage: str, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """The stage's report; each rank's `adapters` lists every adapter (loaded, gone, stale)."""
        return self._call("GET", f"/v1/stages/{_seg(stage)}/adapters", None, idempotency_key)

    def add_adapter(
        self,
        stage: str,
        name: str,
        source: str,
        *,
        rank: int | None = None,
        target_modules: list[str] | None = None,
        version: int = 1,
        base_version: int | None = None,
        pinned: bool = False,
        rebind: bool = False,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Load adapter `name` from `source`, a PEFT directory under allowed_reload_sources."""
        body = {
            "name": name,
            "source": source,
            "rank": rank,
            "target_modules": target_modules,
            "version": version,
            "base_version": base_version,
            "pinned": pinned,
            "rebind": rebind,
            "timeout_s": timeout_s,
        }
        return self._call("POST", f"/v1/stages/{_seg(stage)}/adapters", body, idempotency_key)

    def remove_adapter(
        self, stage: str, name: str, *, timeout_s: float | None = None, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        path = f"/v1/stages/{_seg(stage)}/adapters/{_seg(name)}/remove"
        return self._call("POST", path, {"timeout_s": timeout_s}, idempotency_key)

    def pin_adapter(
        self,
        stage: str,
        name: str,
        pinned: bool = True,
        *,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        path = f"/v1/stages/{_seg(stage)}/adapters/{_seg(name)}/pin"
        return self._call("POST", path, {"pinned": pinned, "timeout_s": timeout_s}, idempotency_key)

    # ------------------------------------------------------------------ vLLM-compatible

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    # ------------------------------------------------------------------ transport

    def _call(self, method: str, path: str, body: Any = None, idempotency_key: str | None = None) -> Any:
        # Only the fields given: null is every such field's default, and a body with nulls
        # would not be the one a user sends by hand under the same Idempotency-Key.
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if v is not None}
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read() or b"null")
                if isinstance(answer, dict):
                    answer = Reply(answer)
                    answer.replayed = response.headers.get("Idempotent-Replayed", "").lower() == "true"
                return answer
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                parsed = json.loads(raw)
                error = parsed["error"]
                raise ServeError(exc.code, str(error.get("type")), str(error.get("message")), parsed) from None
            except (ValueError, KeyError, TypeError):
                raise ServeError(
                    exc.code, "HTTPError", f"HTTP {exc.code} from {method} {path}: {raw[:500].decode(errors='replace')}"
                ) from None
        except urllib.error.URLError as exc:
            raise ServeError(
                0, "Unreachable", f"cannot reach {self.url}: {exc.reason}; is `omni-core serve` running there?"
            ) from None


def _seg(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _list(tags: Iterable[str] | None) -> list[str] | None:
    if tags is None:
        return None
    return [tags] if isinstance(tags, str) else list(tags)
