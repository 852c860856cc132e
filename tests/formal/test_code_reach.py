"""Nothing the cores reach is unreached by the models without a reason (tla/code_reach.md)."""

from __future__ import annotations

from omni_core.formal.manifest import tla_dir
from tests.formal import code_reach


def test_every_key_the_code_reaches_and_no_model_does_is_explained_and_reported() -> None:
    code, models = code_reach.code_keys(), code_reach.model_keys()
    found = code_reach.gaps(code, models)
    by_rule, unexplained = code_reach.explain(found)
    assert not unexplained, (
        f"the code reaches {unexplained}, which no model reaches: model it (and run omni-core check "
        "--update-manifest) or explain it in tests/formal/code_reach.py's EXPLAINED"
    )
    idle = [name for name, keys in by_rule.items() if not keys]
    assert not idle, f"the rules {idle} explain nothing now (the models reach it): drop them"
    report = tla_dir() / code_reach.REPORT
    assert report.read_text() == code_reach.render(code, models), "run: python -m tests.formal.code_reach"


def test_a_row_the_models_stop_reaching_is_named() -> None:
    """The check has teeth: a models' report that loses a row the code reaches fails it."""
    code, models = code_reach.code_keys(), code_reach.model_keys()
    models["srow"].discard("SLEEPING/wake")
    _, unexplained = code_reach.explain(code_reach.gaps(code, models))
    assert unexplained == ["srow:SLEEPING/wake"]
