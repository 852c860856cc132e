"""Coverage-guided fuzzing of the codec with atheris (libFuzzer for Python), optional.

`python -m omni_testing.fuzz.atheris_codec [libFuzzer flags] [CORPUS_DIR ...]`, e.g.
`-atheris_runs=200000` or `-max_total_time=60`. Without a corpus directory it starts from
one valid message of every type (the structured generator's corpus). The properties:

- `decode` and `decode_command` raise nothing but `ProtocolError`, whatever the bytes (P-10);
- a message that decodes re-encodes to bytes that decode to the same bytes again (the codec
  is stable: what a peer forwards or caches is what it read).

atheris instruments the Python code it imports (the codec's `_explain`/`_describe` paths);
msgspec's C decoder is not instrumented, so on that part the guidance is coarse and the
structured fuzzer (`python -m omni_testing.fuzz`) does the heavy lifting.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import atheris

# First, so that the codec is imported (and instrumented) here and not by anything before.
with atheris.instrument_imports():
    from omni_core.protocol import ProtocolError, decode, decode_command, encode

from omni_testing.fuzz.generate import write_seed_corpus


def test_one_input(data: bytes) -> None:
    try:
        message = decode(data)
    except ProtocolError:
        message = None
    with contextlib.suppress(ProtocolError):
        decode_command(data)
    if message is not None:
        once = encode(message)
        twice = encode(decode(once))
        if once != twice:
            raise AssertionError(f"re-encoding is not stable: {once.hex()} -> {twice.hex()}")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv if argv is None else argv)
    if not any(not a.startswith("-") for a in args[1:]):  # no corpus given: a seeded one
        corpus = Path(tempfile.mkdtemp(prefix="omni-atheris-"))
        write_seed_corpus(corpus)
        args.append(str(corpus))
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
