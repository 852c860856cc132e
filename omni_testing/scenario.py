"""The scenario file format, etcd's datadriven layout: `# comments`, a command line, `----`,
and the transcript expected of it up to a blank line."""

from __future__ import annotations

from dataclasses import dataclass

from omni_testing.script import Script, ScriptError


@dataclass
class Block:
    """One command of a scenario file: the comment and blank lines before it, the command,
    and (in a file with golden output) the lines expected after `----`."""

    preamble: list[str]
    command: str
    expected: list[str] | None = None


def parse_blocks(text: str) -> tuple[list[Block], list[str]]:
    """etcd's datadriven layout: `# comments`, a command line, `----`, the expected output
    up to a blank line. A file without `----` lines (the walkthrough) is commands only.
    Returns the blocks and the trailing comment lines."""
    lines = text.splitlines()
    blocks: list[Block] = []
    preamble: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            preamble.append(line)
            i += 1
            continue
        block = Block(preamble, line.strip())
        preamble = []
        i += 1
        if i < len(lines) and lines[i] == "----":
            i += 1
            block.expected = []
            while i < len(lines) and lines[i].strip():
                block.expected.append(lines[i])
                i += 1
        blocks.append(block)
    return blocks, preamble


def render_blocks(blocks: list[Block], outputs: list[list[str]], trailer: list[str]) -> str:
    """The file again with `outputs` as the expected sections (the --rewrite mode)."""
    out: list[str] = []
    for index, (block, got) in enumerate(zip(blocks, outputs, strict=True)):
        preamble = list(block.preamble)
        while index and preamble and not preamble[0].strip():
            preamble.pop(0)  # one blank line between blocks, written below
        out += [*preamble, block.command, "----", *got, ""]
    while out and not out[-1].strip():
        out.pop()
    trailer = list(trailer)
    while trailer and not trailer[0].strip():
        trailer.pop(0)
    out += ([""] + trailer) if trailer else []
    return "\n".join(out) + "\n"


def run_blocks(blocks: list[Block]) -> list[list[str]]:
    """Each block's command on one Script, in order: its transcript lines."""
    script = Script()
    outputs = []
    for number, block in enumerate(blocks, 1):
        try:
            outputs.append(script.run(block.command))
        except ScriptError as exc:
            raise ScriptError(f"command {number} ({block.command!r}): {exc}") from exc
    return outputs
