"""A rank's profiler for the Profile command: `torch.profiler` around whatever the rank does
between a start and a stop (requests, sleeps, wakes), written as a gzip Chrome trace.

- One profile at a time per rank; the worker core answers a second start ALREADY before it
  gets here.
- A trace is named `{stage}-rank{r}-{prefix}-{time}.json.gz` (no prefix: `{stage}-rank{r}-
  {time}.json.gz`), `time` the stop's UTC time to the microsecond (`20261123T154801.123456Z`),
  strictly increasing within the process, so stages, ranks and stops never overwrite each
  other and the names sort by time.
- The stop exports the trace as JSON on the loop's thread (the profiler's data lives there)
  and hands it to one compressing thread, so the Ack does not wait for gzip. Compression
  writes `.{name}.part` and renames it: a listed path exists only once it is complete. At
  most `MAX_PENDING_COMPRESSIONS` wait; a stop beyond that waits for room (backpressure).
- Bounded: the profiler keeps every event in memory until it stops, so a profile running
  longer than `max_duration_s` is cut by `poll()` (the worker calls it from its loop): its
  trace is written then, and the next stop lists that path (and starts nothing new).
"""

from __future__ import annotations

import datetime
import gzip
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omni_core.worker.profiler")

MAX_PENDING_COMPRESSIONS = 4
DEFAULT_PROFILE_MAX_S = 600.0
_ONE_US = datetime.timedelta(microseconds=1)
_UTC = datetime.timezone.utc  # not datetime.UTC: that needs Python 3.11, the package runs on 3.10


def default_profile_dir() -> str:
    """Where traces go when the stage names no `profile_dir`: under the system's temp folder,
    so a run never writes into the working tree unasked."""
    return os.path.join(tempfile.gettempdir(), "omni-core-profiles")


def trace_name(stage: str, rank: int, prefix: str | None, stamp: datetime.datetime) -> str:
    time_text = stamp.strftime("%Y%m%dT%H%M%S.%fZ")
    middle = f"-{prefix}" if prefix else ""
    return f"{stage}-rank{rank}{middle}-{time_text}.json.gz"


def _torch_profiler(device_type: str) -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


class TraceProfiler:
    """Start/stop of one rank's profiler and the background compression of its traces."""

    def __init__(
        self,
        directory: str,
        stage: str,
        rank: int,
        *,
        device_type: str = "cpu",
        max_duration_s: float = DEFAULT_PROFILE_MAX_S,
        make_profiler: Callable[[str], Any] = _torch_profiler,
        clock: Callable[[], float] = time.monotonic,
        utc_now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(_UTC),
    ) -> None:
        if max_duration_s <= 0:
            raise ValueError(f"profile max_duration_s must be > 0, got {max_duration_s!r}")
        self.directory = os.path.abspath(directory)
        self.stage, self.rank, self.device_type = stage, rank, device_type
        self.max_duration_s = max_duration_s
        self._make_profiler, self._clock, self._utc_now = make_profiler, clock, utc_now
        self._profiler: Any = None
        self._prefix: str | None = None
        self._started_at = 0.0
        self._cut_paths: list[str] = []  # written by poll(), listed by the next stop
        self._last_stamp: datetime.datetime | None = None
        self._jobs: queue.Queue[tuple[str, str] | None] = queue.Queue(MAX_PENDING_COMPRESSIONS)
        self._thread: threading.Thread | None = None
        self.compression_errors: list[str] = []

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self, prefix: str | None) -> None:
        if self._profiler is not None or self._cut_paths:
            raise RuntimeError(
                "a profile is already running on this rank (or its cut trace is not yet collected); stop it first"
            )
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        profiler = self._make_profiler(self.device_type)
        profiler.start()
        self._profiler, self._prefix, self._started_at = profiler, prefix, self._clock()

    def stop(self) -> tuple[str, ...]:
        """Stop the running profile (if `poll` did not cut it already) and return the final
        paths of its traces; they exist once compressed (`wait`)."""
        paths = list(self._cut_paths)
        self._cut_paths.clear()
        if self._profiler is not None:
            paths.append(self._stop_and_export())
        return tuple(paths)

    def poll(self) -> None:
        """Cut a profile that ran past `max_duration_s` (its events grow without bound)."""
        if self._profiler is not None and self._clock() - self._started_at >= self.max_duration_s:
            path = self._stop_and_export()
            self._cut_paths.append(path)
            log.warning(
                "profile of %s rank %d ran %.0f s, its limit (profile_max_s): cut and written to %s; "
                "the next Profile stop lists it",
                self.stage,
                self.rank,
                self.max_duration_s,
                path,
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Drop a running profile (nobody is left to ask for it) and let queued compressions
        finish, waiting at most `timeout_s`."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            try:
                profiler.stop()
            except Exception:  # the process is ending; a profiler that fails to stop changes nothing
                log.exception("profiler of %s rank %d failed to stop at shutdown", self.stage, self.rank)
        self.wait(timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Whether every queued trace was compressed within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._jobs.unfinished_tasks

    # ------------------------------------------------------------------ internals

    def _stop_and_export(self) -> str:
        profiler, self._profiler = self._profiler, None  # dropped even if the export raises
        profiler.stop()
        final = os.path.join(self.directory, self._unique_name())
        raw = os.path.join(self.directory, f".{os.path.basename(final)[: -len('.gz')]}.part")
        profiler.export_chrome_trace(raw)
        self._compress_later(raw, final)
        return final

    def _unique_name(self) -> str:
        stamp = self._utc_now()
        if self._last_stamp is not None and stamp <= self._last_stamp:
            stamp = self._last_stamp + _ONE_US
        while os.path.exists(os.path.join(self.directory, trace_name(self.stage, self.rank, self._prefix, stamp))):
            stamp += _ONE_US  # another process of this rank (an earlier epoch) wrote this instant
        self._last_stamp = stamp
        return trace_name(self.stage, self.rank, self._prefix, stamp)

    def _compress_later(self, raw: str, final: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compress_loop, name="omni-profile-gzip", daemon=True)
            self._thread.start()
        self._jobs.put((raw, final))  # blocks while MAX_PENDING_COMPRESSIONS wait: backpressure

    def _compress_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is not None:
                    self._compress(*job)
            finally:
                self._jobs.task_done()

    def _compress(self, raw: str, final: str) -> None:
        part = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.part")
        try:
            with open(raw, "rb") as source, gzip.open(part, "wb", compresslevel=6) as target:
                shutil.copyfileobj(source, target, 1 << 20)
            os.replace(part, final)  # the listed path appears complete or not at all
        except OSError as exc:
            self.compression_errors.append(f"{final}: {exc}")
            log.error("profile trace %s could not be written: %s", final, exc)
            if os.path.exists(part):
                os.remove(part)
        finally:
            if os.path.exists(raw):
                os.remove(raw)
