"""The P-21 cases (SaveWeights): a save writes the version held, whole or not at all, and only
where valid weights are awake; and the P-17 case of a worker that greets NEEDS_RELOAD (rule
10). The suite and the worker share a file system here (the suite starts its workers on its
own host): the cases write under a fresh directory of the suite's and read back what the
worker wrote there."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from omni_core.conformance.cases import LEVEL2, PARTIAL_WAKE, Ctx, case
from omni_core.conformance.cases_weights import WEIGHT_UPDATE, _self_update
from omni_core.protocol import AckStatus, Execute, Nack, NackReason, ReloadWeights, SaveWeights, Shutdown, WorkerState

SAVE_WEIGHTS = "save_weights"  # the capability a worker declares when it answers SaveWeights
INDEX_FILE = "omni_weights.json"  # P-21: the index every save holds


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="omni-conf-save-")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _save(ctx: Ctx, directory: str, what: str, **fields: Any) -> SaveWeights:
    command: SaveWeights = ctx.cmd(SaveWeights, what, directory=directory, **fields)
    return command


@case(
    "P-21",
    "save_refused_without_save_weights",
    "no 'save_weights' declared: SaveWeights is refused UNSUPPORTED (BAD_MESSAGE from a worker that "
    "predates the message: an unknown type, P-10), nothing written, Execute's output unchanged",
    unless=(SAVE_WEIGHTS,),
)
def save_refused_without_save_weights(ctx: Ctx) -> None:
    first = ctx.execute()
    with _scratch() as root:
        save = _save(ctx, os.path.join(root, "w"), "unsupported")
        reply = ctx.request(save)
        known = isinstance(reply, Nack) and reply.reason is NackReason.UNSUPPORTED
        ctx.nack(reply, save, NackReason.UNSUPPORTED if known else NackReason.BAD_MESSAGE, state=WorkerState.ACTIVE)
        ctx.check(not os.listdir(root), "a refused SaveWeights wrote files", sent=save, got=os.listdir(root))
    ctx.same_output(first, "after a refused SaveWeights")


@case(
    "P-21",
    "save_writes_the_version_whole",
    "'save_weights' declared: SaveWeights in ACTIVE is acknowledged OK in ACTIVE with equal pool bytes "
    "before and after; the directory holds an index naming the worker's weights version and nothing else "
    "is left beside it; a copy gets the same Ack; a second save to it is refused INVALID_ARGUMENT, so is "
    "a relative path and a path through a symlink, each writing nothing; with overwrite it is replaced",
    needs=(SAVE_WEIGHTS,),
)
def save_writes_the_version_whole(ctx: Ctx) -> None:
    version = ctx.status().weights_version
    with _scratch() as root:
        target = os.path.join(root, "saved")
        save = _save(ctx, target, "first")
        ack = ctx.ack(ctx.request(save), save, state=WorkerState.ACTIVE, status=AckStatus.OK)
        memory = ack.memory
        ctx.check(
            memory is None or memory.pool_bytes_before == memory.pool_bytes_after,
            "SaveWeights moved pool memory",
            sent=save,
            got=ack,
            expected="equal pool bytes before and after",
        )
        _check_index(ctx, save, target, version)
        ctx.check(os.listdir(root) == ["saved"], "a save left files beside its target", got=os.listdir(root))
        ctx.check(ctx.request(save) == ack, "a copy of the answered SaveWeights got another answer", sent=save)
        for what, directory in (("again", target), ("relative", "relative/saved"), ("link", _link(root))):
            refused = _save(ctx, directory, what)
            ctx.nack(ctx.request(refused), refused, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
        ctx.check(
            sorted(os.listdir(root)) == ["link", "real", "saved"] and not os.listdir(os.path.join(root, "real")),
            "a refused SaveWeights wrote files",
            got=sorted(os.listdir(root)),
        )
        replace = _save(ctx, target, "overwrite", overwrite=True)
        ctx.ack(ctx.request(replace), replace, state=WorkerState.ACTIVE, status=AckStatus.OK)
        _check_index(ctx, replace, target, version)


def _link(root: str) -> str:
    real = os.path.join(root, "real")
    os.mkdir(real)
    os.symlink(real, os.path.join(root, "link"))
    return os.path.join(root, "link", "saved")


def _check_index(ctx: Ctx, save: SaveWeights, target: str, version: int) -> None:
    try:
        with open(os.path.join(target, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        ctx.check(False, f"the saved directory has no readable {INDEX_FILE} ({exc})", sent=save)
        return
    ctx.check(
        isinstance(index, dict) and index.get("weights_version") == version,
        f"the save's index does not name weights version {version}",
        sent=save,
        got=index,
        expected={"weights_version": version},
    )


@case(
    "P-21",
    "save_needs_weights_awake",
    "'save_weights' declared: after a level-1 Sleep, SaveWeights is refused INVALID_STATE naming the "
    "state, nothing written; with 'partial_wake', in PARTIAL with the weights asleep too",
    needs=(SAVE_WEIGHTS,),
)
def save_needs_weights_awake(ctx: Ctx) -> None:
    with _scratch() as root:
        _, slept = ctx.sleep(1)
        asleep = _save(ctx, os.path.join(root, "asleep"), "asleep")
        ctx.nack(ctx.request(asleep), asleep, NackReason.INVALID_STATE, state=slept.state, names_state=True)
        tags = ctx.worker.tags
        if PARTIAL_WAKE in ctx.worker.capabilities and "weights" in tags and len(tags) > 1:
            _, woke = ctx.wake(tags=tuple(t for t in tags if t != "weights")[:1])
            partial = _save(ctx, os.path.join(root, "partial"), "partial")
            ctx.nack(ctx.request(partial), partial, NackReason.INVALID_STATE, state=woke.state)
        ctx.check(not os.listdir(root), "a refused SaveWeights wrote files", got=os.listdir(root))
        ctx.back_to_active()


@case(
    "P-21",
    "save_reloads_bit_for_bit",
    "'save_weights' and 'level2' declared: a save, a level-2 Sleep and Wake (NEEDS_RELOAD), then "
    "ReloadWeights from the saved directory: ACTIVE, and Execute returns what it returned before the save",
    needs=(SAVE_WEIGHTS, LEVEL2),
)
def save_reloads_bit_for_bit(ctx: Ctx) -> None:
    first = ctx.execute()
    with _scratch() as root:
        target = os.path.join(root, "saved")
        save = _save(ctx, target, "round-trip")
        ctx.ack(ctx.request(save), save, state=WorkerState.ACTIVE, status=AckStatus.OK)
        ctx.sleep(2)
        _, woke = ctx.wake()
        ctx.check(woke.state is WorkerState.NEEDS_RELOAD, "a level-2 Sleep and Wake did not end NEEDS_RELOAD", got=woke)
        reload = ctx.cmd(ReloadWeights, "from-save", source=target)
        ctx.ack(ctx.request(reload), reload, state=WorkerState.ACTIVE)
    ctx.same_output(first, "after a reload of what the worker saved")


@case(
    "P-21",
    "save_reload_names_the_saved_version",
    "'save_weights', 'weight_update' and 'level2' declared: an update to version v, a save, an update "
    "to v+1, a level-2 Sleep and Wake, then ReloadWeights of the save: acknowledged ACTIVE at version v "
    "(the one its index names, not 0), Status names v, and Execute returns what it returned at v",
    needs=(SAVE_WEIGHTS, WEIGHT_UPDATE, LEVEL2),
)
def save_reload_names_the_saved_version(ctx: Ctx) -> None:
    version = ctx.status().weights_version + 1
    _self_update(ctx, version)
    at_version = ctx.execute()
    with _scratch() as root:
        target = os.path.join(root, "saved")
        save = _save(ctx, target, "at-version")
        ctx.ack(ctx.request(save), save, state=WorkerState.ACTIVE, status=AckStatus.OK)
        _self_update(ctx, version + 1)
        ctx.sleep(2)
        ctx.wake()
        reload = ctx.cmd(ReloadWeights, "saved-version", source=target)
        done = ctx.ack(ctx.request(reload), reload, state=WorkerState.ACTIVE)
        for what, reply in (("Ack", done), ("Status", ctx.status())):
            ctx.check(
                reply.weights_version == version,
                f"after a reload of a save at version {version}, the {what} names version {reply.weights_version}",
                sent=reload,
                got=reply,
                expected=f"weights_version {version}, the one the save's index names",
            )
    ctx.same_output(at_version, "after a reload of a save")


@case(
    "P-17",
    "greeted_needs_reload_serves_nothing_until_weights_come",
    "a worker started with its weights not to be served (a restart under a version floor; the table's "
    "loaded_needs_reload row) greets NEEDS_RELOAD at weights version 0, refuses Execute INVALID_STATE "
    "naming the state, says NEEDS_RELOAD in Status, and serves once a ReloadWeights completes (rule 11)",
    scope="own",
)
def greeted_needs_reload_serves_nothing_until_weights_come(ctx: Ctx) -> None:
    if ctx.needs_reload_factory is None:
        ctx.skip(
            "no worker to start in NEEDS_RELOAD: name one that greets so with --needs-reload-worker TARGET "
            "or SuiteOptions(needs_reload_worker=...)"
        )
    start = ctx.own_harness().start
    (peer,) = start([0], ctx.options.epoch, factory=ctx.needs_reload_factory, state=WorkerState.NEEDS_RELOAD)
    assert peer.hello is not None
    ctx.check(
        peer.hello.weights_version == 0,
        "a worker greeting NEEDS_RELOAD claims a weights version",
        got=peer.hello,
        expected="Hello state NEEDS_RELOAD, weights_version 0",
    )
    run = ctx.cmd(Execute, peer=peer, payload=ctx.options.execute_payload)
    ctx.nack(ctx.request(run, peer), run, NackReason.INVALID_STATE, state=WorkerState.NEEDS_RELOAD, names_state=True)
    status = ctx.status(peer)
    ctx.check(status.state is WorkerState.NEEDS_RELOAD, "Status does not say NEEDS_RELOAD", got=status)
    reload = ctx.cmd(ReloadWeights, "after-greeting", peer=peer)
    ctx.ack(ctx.request(reload, peer), reload, state=WorkerState.ACTIVE)
    ran = ctx.cmd(Execute, "after-reload", peer=peer, payload=ctx.options.execute_payload)
    ctx.executed_or_runner_error(ran, ctx.request(ran, peer))
    shutdown = ctx.cmd(Shutdown, peer=peer)
    ctx.ack(ctx.request(shutdown, peer), shutdown, state=WorkerState.STOPPED, status=AckStatus.OK)
