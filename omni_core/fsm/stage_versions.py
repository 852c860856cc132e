"""What a stage remembers of its weights version across restarts: where the committed version
lives durably, and what fresh ranks start from.

A version the stage committed from a directory (a disk update, a reload from a source) or
saved to one (SaveWeights) can be brought back by a restart: the fresh ranks load their checkpoint, then that
directory, and say Hello at that version. A version that came from memory (shared memory,
CUDA IPC, a collective, a stage-to-stage transfer) exists nowhere a fresh process can read
it: the ranks come back NEEDS_RELOAD under a version floor, and nothing runs until an update
at or above the floor, or a restart that the caller asked to start over from the checkpoint
(`from_checkpoint`), which resets the version to 0 and says so. Versions never go backwards
across epochs unless the caller reset them (tla/OmniVersions.tla, NoSilentRevert).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_core.protocol import Command


@dataclass(frozen=True)
class StartWeights:
    """What a stage's fresh ranks start from: their checkpoint, then `source` when given (a
    directory holding `version`); or, with `needs_reload`, their checkpoint loaded but not
    trusted: NEEDS_RELOAD, version 0, until an update at or above `floor`."""

    source: str | None = None
    version: int = 0
    needs_reload: bool = False
    floor: int = 0


@dataclass(frozen=True)
class VersionReset:
    """A restart that the caller asked to start from the checkpoint dropped `from_version`."""

    from_version: int
    epoch: int


class VersionKeeper:
    """The durable source of the stage's committed version, from the commands it committed.

    `durable` is False while the committed version came from memory; `source` is the directory
    that holds it (None with `durable`: the runner's own checkpoint)."""

    def __init__(self, *, dummy: bool = False) -> None:
        self.durable = True  # version 0 is the runner's own checkpoint
        self.source: str | None = None
        # The runner's own weights are random (load_format "dummy"): version 0 is no checkpoint,
        # so fresh ranks from it come back NEEDS_RELOAD, never serving what nobody trained.
        self.dummy = dummy
        self.floor = 0  # a version the stage must not serve below (a lost in-memory version)
        self.last_reset: VersionReset | None = None

    @property
    def kind(self) -> str:
        """How status names it: 'checkpoint' ('dummy' where that is random), 'disk' or 'memory'."""
        if not self.durable:
            return "memory"
        if self.source is None:
            return "dummy" if self.dummy else "checkpoint"
        return "disk"

    def first_start(self) -> StartWeights | None:
        """What a first start's ranks start from: dummy weights are NEEDS_RELOAD at version 0
        until an update; None: the version their Hellos name."""
        return StartWeights(needs_reload=True) if self.dummy else None

    def committed(self, command: Command, version: int) -> None:
        """Every rank ACKed `command` at `version`: where that version now lives."""
        written = command.writes_weights
        if written is not None:
            self.durable, self.source = written
        if version >= self.floor:
            self.floor = 0

    def saved(self, directory: str, version: int) -> None:
        """Every rank wrote `version`, the committed one, to `directory` (SaveWeights): a version
        that lived in memory only is durable from now on."""
        self.durable, self.source = True, directory

    def plan_restart(self, version: int, epoch: int, *, from_checkpoint: bool) -> StartWeights:
        """What the ranks of a restart start from, the stage at `version` before it."""
        if from_checkpoint:
            lost = max(version, self.floor)
            self.last_reset = VersionReset(lost, epoch) if lost else None
            self.durable, self.source, self.floor = True, None, 0
            return StartWeights(needs_reload=self.dummy)
        wanted = max(version, self.floor)
        if self.durable and wanted == version:
            # The runner's own checkpoint, when dummy, is nothing to serve: NEEDS_RELOAD at 0.
            return StartWeights(source=self.source, version=version, needs_reload=self.dummy and self.source is None)
        # The version lived in memory only: what fresh ranks load is older than it.
        self.durable, self.source, self.floor = False, None, wanted
        return StartWeights(needs_reload=True, floor=wanted)

    def refusal_below_floor(self, stage: str, version: int) -> str:
        """Why an update to `version` is refused under the floor, or ''."""
        if version >= self.floor:
            return ""
        return (
            f"stage {stage!r}: weights version {version} is below the stage's version floor "
            f"{self.floor} (the version it held before its restart, which lived in memory only); "
            f"send version {self.floor} or above, or restart(from_checkpoint=True) to start over at 0"
        )

    @staticmethod
    def dummy_reload_refusal(stage: str) -> str:
        """Why a reload of a dummy runner's own weights is refused (vLLM refuses it so too)."""
        return (
            f"Model reloading with dummy format: stage {stage!r} loaded no checkpoint (load_format "
            "'dummy'), so its own weights are random; reload from a checkpoint directory (source) or "
            "update its weights (update_weights)"
        )

    def dummy_detail(self, stage: str) -> str:
        """What a request to a stage still on its dummy weights is told."""
        return (
            f"stage {stage!r} is NEEDS_RELOAD: it started with dummy weights (load_format 'dummy'), which "
            "no checkpoint holds; update its weights (update_weights, or a transfer from its trainer) to serve"
        )

    def floor_detail(self, stage: str) -> str:
        """What a request refused under the floor is told."""
        return (
            f"stage {stage!r} is NEEDS_RELOAD: it restarted from version {self.floor}, which lived in "
            f"memory only, so its fresh ranks hold no weights at or above it; update its weights to "
            f"version {self.floor} or above (update_weights), or restart(from_checkpoint=True) to serve "
            "the checkpoint at version 0"
        )
