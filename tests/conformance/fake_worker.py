"""A worker that misbehaves at start-up, for tests of the suite's own robustness (no torch).

python fake_worker.py MODE ADDRESS RANK EPOCH
"""

from __future__ import annotations

import sys
import time

import zmq

from omni_core.protocol import Ack, AckStatus, Hello, Nack, NackReason, WorkerState, decode, encode


def main() -> int:
    mode, address, rank, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "exit":
        print("fake worker: giving up", flush=True)
        return 3
    if mode == "exit-control":  # output no XML document may carry as it is
        sys.stdout.buffer.write(b"fake worker: \x00\x1b[31m \xff\xfe giving up\n")
        return 3
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    hello = Hello(task_id="hello", epoch=epoch, rank=rank, pid=1, device="cpu", backend="fake", tags=("weights",))
    if mode == "ack-first":
        sock.send(encode(Ack(task_id="x", epoch=epoch, rank=rank, command="Status", state=WorkerState.ACTIVE)))
    elif mode == "wrong-rank":
        sock.send(
            encode(
                Hello(
                    task_id="hello", epoch=epoch, rank=rank + 5, pid=1, device="cpu", backend="fake", tags=("weights",)
                )
            )
        )
    elif mode == "bad-utf8-detail":  # every answer a Nack whose detail is not UTF-8
        sock.send(encode(hello))
        while True:
            sock.recv()
            nack = Nack(
                task_id="-",
                epoch=epoch,
                rank=rank,
                command="?",
                reason=NackReason.BAD_MESSAGE,
                detail="@@@@",
                state=WorkerState.ACTIVE,
            )
            sock.send(encode(nack).replace(b"@@@@", b"\xff\xfe\x00\x1b"))
    elif mode == "no-tags":  # a Hello without tags, then "ALREADY" to every command
        sock.send(encode(Hello(task_id="hello", epoch=epoch, rank=rank, pid=1, device="cpu", backend="fake", tags=())))
        while True:
            command = decode(sock.recv())
            name = type(command).__name__
            sock.send(
                encode(
                    Ack(
                        task_id=command.task_id,
                        epoch=command.epoch,
                        rank=rank,
                        command=name,
                        state=WorkerState.ACTIVE,
                        status=AckStatus.ALREADY,
                    )
                )
            )
    elif mode == "garbage-replies":
        sock.send(encode(hello))
        while True:
            sock.recv()
            sock.send(b"\x00garbage")
    time.sleep(60)  # "silent", and the others after their one message
    return 0


if __name__ == "__main__":
    sys.exit(main())
