"""A stranger on the engine's host: another process that connects to the engine's ROUTER and
sends whatever it is given. Run as `python -m tests.engine.stranger ADDRESS FRAMES.json`;
FRAMES.json is a list of {"identity": hex or null, "frames": [hex, ...]}. Each entry goes out
on a DEALER of its own (so it may claim any identity), then the process waits for the bytes
to leave and exits 0. It prints nothing it receives: an engine never answers a stranger."""

from __future__ import annotations

import json
import sys

import zmq


def main(address: str, frames_path: str, curve_keys: str | None = None) -> int:
    with open(frames_path) as f:
        entries = json.load(f)
    ctx = zmq.Context()
    sockets = []
    for entry in entries:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)  # deliver before exiting
        if entry.get("identity"):
            sock.setsockopt(zmq.IDENTITY, bytes.fromhex(entry["identity"]))
        if curve_keys:  # a CURVE client with keys of its own: not the engine's
            (server_public,) = curve_keys.split(",")
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public.encode(), public, secret
        sock.connect(address)
        sock.send_multipart([bytes.fromhex(part) for part in entry["frames"]])
        sockets.append(sock)
    for sock in sockets:
        sock.close()
    ctx.term()
    print(f"sent {len(entries)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
