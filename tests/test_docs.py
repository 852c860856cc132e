from pathlib import Path

from omni_core.fsm.docs import render_lifecycles

ROOT = Path(__file__).resolve().parents[1]


def test_lifecycle_docs_are_generated_from_the_tables() -> None:
    committed = (ROOT / "docs" / "lifecycles.md").read_text()
    assert committed == render_lifecycles(), "docs/lifecycles.md is stale: run `omni-core docs`"


def test_every_requirement_is_numbered_and_a_must() -> None:
    text = (ROOT / "specs" / "protocol.md").read_text()
    numbers = [
        int(line.split("**P-")[1].split(" ")[0].rstrip(".")) for line in text.splitlines() if line.startswith("**P-")
    ]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    for n in numbers:
        block = text.split(f"**P-{n} ")[1].split("**P-")[0]
        assert "MUST" in block, f"P-{n} states no MUST"
