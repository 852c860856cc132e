"""P-17 end to end on CPU: a trainer's tensors into a running stage over shared memory,
disk and a gloo broadcast; the stage's output after each update equals a plain copy of the
model holding the same weights, through sleeps and wakes; every refusal leaves the version."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from omni_core.engine import Engine, ExecuteResult
from omni_core.engine.errors import InvalidArgumentError, WeightUpdateFailedError
from omni_core.protocol import ShmSource
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, SMALL_RUNNER, in_thread, rank_pid, resume, small_spec, wait_for


def reference(seed: int) -> SyntheticRunner:
    """The same model in this process: what the stage must compute for the same weights."""
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=seed))
    runner.load_weights()
    runner.allocate_caches()
    return runner


def new_weights(runner: SyntheticRunner, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen, dtype=dtype) * 0.05
        for name, (shape, dtype) in runner.weight_specs().items()
    }


def digest(engine: Engine, stage: str) -> str:
    return engine.execute(stage, PROBE)["sha256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shm_updates_in_every_resident_state_and_wakes_bring_back_the_new_weights(engine_factory) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)  # small_spec seeds the runner with len(name)
    original = digest(engine, "r")
    assert original == ref.execute(PROBE)["sha256"]
    with WeightSender(bucket_bytes=1 << 20) as sender:
        # RUNNING: drained, written, committed at version 1.
        v1 = new_weights(ref, 11)
        report = engine.update_weights("r", sender.share(v1), version=1, task_id="u1")
        assert (report.state, report.weights_version, report.ranks[0].weights_version) == ("RUNNING", 1, 1)
        ref.update_weights(v1.items())
        after_v1 = ref.execute(PROBE)["sha256"]
        assert after_v1 != original and digest(engine, "r") == after_v1
        assert engine.status()["r"]["weights_version"] == 1

        # The RL bug: a sleep and wake after an update restores the update, never the load.
        engine.sleep("r", 1)
        engine.wake("r")
        assert digest(engine, "r") == after_v1

        # A copy of the task is answered from the record; a version not above is refused.
        assert engine.update_weights("r", sender.share(v1), version=1, task_id="u1").weights_version == 1
        with pytest.raises(InvalidArgumentError, match="version 1 is not above the stage's version 1"):
            engine.update_weights("r", sender.share(v1), version=1)

        # Refused before writing, naming the tensor; the version and the output stay.
        wrong = dict(v1, w0=torch.zeros(3, 3))
        with pytest.raises(InvalidArgumentError, match=r"tensor 'w0' is float32 \[3, 3\], the model's is"):
            engine.update_weights("r", sender.share(wrong), version=2)
        with pytest.raises(InvalidArgumentError, match="'extra' is not a weight of this model"):
            engine.update_weights("r", sender.share(dict(v1, extra=torch.zeros(2))), version=2)
        with pytest.raises(InvalidArgumentError, match="is bfloat16"):
            engine.update_weights("r", sender.share({**v1, "w1": v1["w1"].bfloat16()}), version=2)
        assert engine.status()["r"]["weights_version"] == 1 and digest(engine, "r") == after_v1

        # NEEDS_RELOAD after a level-2 sleep: the update replaces the reload.
        engine.sleep("r", 2)
        engine.wake("r")
        assert engine.status()["r"]["state"] == "NEEDS_RELOAD"
        v2 = new_weights(ref, 12)
        assert engine.update_weights("r", sender.share(v2), version=2).state == "RUNNING"
        ref.update_weights(v2.items())
        assert digest(engine, "r") == ref.execute(PROBE)["sha256"]
        assert sender.reused >= 1  # the same layout refilled the same buckets

        # PARTIAL with the weights awake takes it (SLEEPING too, into the host copy:
        # tests/engine/test_host_refit.py).
        engine.sleep("r", 1)
        engine.wake("r", "weights")
        v3 = new_weights(ref, 13)
        assert engine.update_weights("r", sender.share(v3), version=3).state == "PARTIAL"
        engine.wake("r")
        ref.update_weights(v3.items())
        assert digest(engine, "r") == ref.execute(PROBE)["sha256"]

    # From disk (the synthetic runner's own 'seed:N' source), any resident state.
    assert engine.update_weights("r", "seed:9", version=4).weights_version == 4
    ref.reload_weights("seed:9")
    assert digest(engine, "r") == ref.execute(PROBE)["sha256"]


def test_a_dead_sender_or_a_gone_bucket_is_refused_by_name_before_writing(engine_factory, tmp_path) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    before = digest(engine, "r")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with WeightSender() as sender:
        source = sender.share(new_weights(ref, 5))
        assert isinstance(source, ShmSource)
        forged = ShmSource(buckets=tuple(msgspec.structs.replace(b, sender_pid=dead.pid) for b in source.buckets))
        with pytest.raises(InvalidArgumentError, match=f"sender pid {dead.pid} of bucket .* no longer runs"):
            engine.update_weights("r", forged, version=1)
        sender.release()  # the files are gone now
        with pytest.raises(InvalidArgumentError, match="cannot be opened"):
            engine.update_weights("r", source, version=1)
    outside = msgspec.structs.replace(source.buckets[0], handle="/etc/passwd")
    with pytest.raises(InvalidArgumentError, match="is not a file directly under /dev/shm"):
        engine.update_weights("r", ShmSource(buckets=(outside,)), version=1)
    status = engine.status()["r"]
    assert (status["state"], status["weights_version"]) == ("RUNNING", 0) and digest(engine, "r") == before


def test_a_symlinked_foreign_or_init_claimed_bucket_is_refused_and_the_stage_keeps_its_version(
    engine_factory, tmp_path
) -> None:
    """Issue 35 item 2 against running ranks: a /dev/shm symlink to a checkpoint-like file the
    caller may not name, a file another user owns, and a planted file claimed for pid 1 are
    each a clean NACK naming what is wrong; the stage stays RUNNING at its version, serving
    the same outputs, and the next honest update is taken."""
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    before = digest(engine, "r")
    planted = []
    with WeightSender() as sender:
        source = sender.share(new_weights(ref, 5))
        assert isinstance(source, ShmSource) and len(source.buckets) == 1
        bucket = source.buckets[0]
        outside = tmp_path / "not-an-allowed-source.bin"
        outside.write_bytes(Path(bucket.handle).read_bytes())  # the very bytes of a valid update
        name = f"/dev/shm/omni-attack-{os.getpid()}"
        link, foreign, claimed = (f"{name}-link", f"{name}-foreign", f"{name}-init")
        try:
            os.symlink(outside, link)
            planted.append(link)
            attacks = [(msgspec.structs.replace(bucket, handle=link), "is a symbolic link")]
            for path in (foreign, claimed):
                with open(path, "wb") as f:
                    f.write(outside.read_bytes())
                planted.append(path)
            attacks.append((msgspec.structs.replace(bucket, handle=claimed, sender_pid=1), "sender pid 1 .* is init"))
            if os.geteuid() == 0:
                os.chown(foreign, 4242, 4242)
                attacks.append((msgspec.structs.replace(bucket, handle=foreign), "owned by uid 4242"))
            for forged, match in attacks:
                with pytest.raises(InvalidArgumentError, match=match):
                    engine.update_weights("r", ShmSource(buckets=(forged,)), version=1)
                status = engine.status()["r"]
                assert (status["state"], status["weights_version"]) == ("RUNNING", 0), match
                assert digest(engine, "r") == before
            assert engine.update_weights("r", source, version=1).weights_version == 1
        finally:
            for path in planted:
                os.unlink(path)


def test_a_gloo_broadcast_reaches_every_rank_and_a_trainer_that_dies_midway_leaves_needs_reload(engine_factory) -> None:
    engine = engine_factory(small_spec("r", ranks=2))
    ref = reference(seed=1)
    port = free_port()
    sender = WeightSender()
    joined = threading.Thread(target=sender.init_group, args=("127.0.0.1", port, 3), kwargs={"timeout_s": 60})
    joined.start()
    report = engine.init_weight_group("r", address="127.0.0.1", port=port, world_size=3, group_timeout_s=20)
    joined.join(60)
    assert report.status == "OK" and sender.group is not None
    v1 = new_weights(ref, 21)
    thread = sender.broadcast_in_thread(v1)
    assert engine.update_weights("r", sender.collective_source(v1), version=1).weights_version == 1
    thread.join(60)
    assert not thread.errors  # type: ignore[attr-defined]
    ref.update_weights(v1.items())
    assert digest(engine, "r") == ref.execute(PROBE)["sha256"]
    # Joining the same group again is ALREADY; the state never moved.
    again = engine.init_weight_group("r", address="127.0.0.1", port=port, world_size=3, group_timeout_s=20)
    assert again.status == "ALREADY" and engine.status()["r"]["state"] == "RUNNING"
    sender.close()


def test_a_trainer_process_that_dies_mid_broadcast_leaves_the_stage_needs_reload(engine_factory) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    port = free_port()
    v1 = new_weights(ref, 31)
    # A trainer omni-core did not start: joins, sends the first tensor of the update, dies.
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, torch
        from omni_core.weights_sender import WeightSender
        s = WeightSender()
        s.init_group("127.0.0.1", {port}, 2, timeout_s=60)
        s.broadcast({{"w0": torch.zeros({list(v1["w0"].shape)})}})
        os._exit(0)
    """),
        ]
    )
    engine.init_weight_group("r", address="127.0.0.1", port=port, world_size=2, group_timeout_s=10)
    with pytest.raises(WeightUpdateFailedError, match="NEEDS_RELOAD at version 0") as failed:
        engine.update_weights("r", WeightSender.collective_source(v1), version=1, timeout_s=60)
    trainer.wait(30)
    assert failed.value.version == 0
    status = engine.status()["r"]
    assert (status["state"], status["weights_version"]) == ("NEEDS_RELOAD", 0)
    with WeightSender() as sender:  # another source brings it back
        assert engine.update_weights("r", sender.share(v1), version=1).state == "RUNNING"
    ref.update_weights(v1.items())
    assert digest(engine, "r") == ref.execute(PROBE)["sha256"]


def test_a_trainer_stage_transfers_its_weights_to_a_rollout_stage(engine_factory) -> None:
    """`Engine.transfer_weights`: the trainer stage's rank 0 shares (ShareWeights), the rollout
    takes them as a version; the trainer's state never moves and a copy of the task is answered
    from both stages' records."""
    engine = engine_factory(small_spec("policy"), small_spec("rollout"))
    trainer, rollout = reference(seed=len("policy")), reference(seed=len("rollout"))
    report = engine.transfer_weights("policy", "rollout", version=1, task_id="t1")
    assert (report.state, report.weights_version, report.task_id) == ("RUNNING", 1, "t1/update")
    rollout.update_weights(trainer.weights_to_share().items())
    assert (
        digest(engine, "rollout")
        == rollout.execute(PROBE)["sha256"]
        != reference(len("rollout")).execute(PROBE)["sha256"]
    )
    assert engine.status()["policy"]["state"] == "RUNNING"
    assert engine.transfer_weights("policy", "rollout", version=1, task_id="t1").weights_version == 1
    with pytest.raises(InvalidArgumentError, match="not above the stage's version 1"):
        engine.transfer_weights("policy", "rollout", version=1)
    engine.sleep("policy", 1)
    with pytest.raises(InvalidArgumentError, match="cannot share weights in SLEEPING"):
        engine.transfer_weights("policy", "rollout", version=2)
    engine.wake("policy", "weights")  # PARTIAL with the weights awake: enough to share
    assert engine.transfer_weights("policy", "rollout", version=2).weights_version == 2
    engine.sleep("rollout", 1)
    engine.wake("rollout")
    assert digest(engine, "rollout") == rollout.execute(PROBE)["sha256"]


def test_the_async_engine_updates_and_transfers() -> None:
    import asyncio

    from omni_core.engine import AsyncEngine

    async def main() -> tuple[int, int, dict]:
        async with AsyncEngine([small_spec("r"), small_spec("pol")]) as engine:
            with WeightSender() as sender:
                first = await engine.update_weights("r", sender.share(new_weights(reference(1), 41)), version=1)
            second = await engine.transfer_weights("pol", "r", version=2)
            result = await engine.execute("r", PROBE, with_version=True)
            assert result.weights_version == 2 and result.output == await engine.execute("r", PROBE)
            return first.weights_version, second.weights_version, await engine.status()

    first, second, status = asyncio.run(main())
    assert (first, second, status["r"]["weights_version"], status["r"]["ranks"][0]["weights_version"]) == (1, 2, 2, 2)


def test_requests_around_an_update_run_on_one_version_each(engine_factory) -> None:
    """A request in flight when the update comes finishes on the old weights (the update
    drains first); one submitted during the update waits (admission 'queue') and runs on the
    new weights; none sees a mix. The rank is frozen (SIGSTOP) to hold the first one open."""
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    old = ref.execute(PROBE)["sha256"]
    pid = rank_pid(engine, "r", 0)
    with WeightSender() as sender:
        v1 = new_weights(ref, 51)
        source = sender.share(v1)
        os.kill(pid, signal.SIGSTOP)
        try:
            before = engine.submit("r", PROBE, timeout_s=60.0, with_version=True)
            wait_for(lambda: engine.status()["r"]["in_flight"] == 1, what="the request in flight")
            updating = in_thread(lambda: engine.update_weights("r", source, version=1, timeout_s=60.0))
            wait_for(lambda: engine.status()["r"]["state"] == "DRAINING", what="DRAINING")
            during = engine.submit("r", PROBE, timeout_s=60.0, with_version=True)
            wait_for(lambda: engine.status()["r"]["queued"] == 1, what="the second request queued")
        finally:
            resume(pid)
        assert updating.result(60).weights_version == 1
    ref.update_weights(v1.items())
    # Each result names the weights version that produced it.
    assert isinstance(before.result(60), ExecuteResult) and before.result(60).weights_version == 0
    assert before.result(60).output["sha256"] == old
    assert during.result(60).weights_version == 1
    assert during.result(60).output["sha256"] == ref.execute(PROBE)["sha256"] != old
    assert engine.execute("r", PROBE, with_version=True).weights_version == 1
