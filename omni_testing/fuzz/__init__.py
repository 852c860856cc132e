"""Structure-aware fuzzing of the wire protocol, both directions, against real processes.

- `msgpack_writer`: a msgpack writer that can emit what msgspec refuses to (invalid UTF-8,
  lying lengths, non-canonical widths, reserved bytes);
- `generate`: seeded frames: valid messages of every type mutated field by field, random
  msgpack, raw bytes, replays and reorderings of valid commands;
- `worker_target`: a real worker process behind a ROUTER, checked by an oracle;
- `engine_target`: a real Engine (in its own process) hit by stranger DEALER sockets;
- `python -m omni_testing.fuzz --target worker|engine ...`: the CLI (see `cli`).
"""
