"""The anchors' weight-version labels over omni-core's integer versions.

SGLang's `weight_version` and vLLM's `weight_version` / `new_version` are opaque strings a
trainer picks ("step-12", a git hash, "3"); omni-core's stage version is a monotonic integer
(P-17: a request runs only on the version every rank committed). An update that carries a
label commits the stage's next integer version, or the label's own value when it is a decimal
integer above the stage's (so a client that counts 1, 2, 3 sees the same numbers in
`/v1/stages`), and the label is kept beside that integer; routes that report a version
(`/get_weight_version`, `/weight_info`, `/get_model_info`) answer the label of the integer the
stage holds, or the integer itself when none was given.

Labels come from the network: each is at most MAX_LABEL_CHARS printable characters, and each
stage keeps the labels of its last MAX_LABELS_PER_STAGE versions (an older version's label
falls back to its integer). Only the event loop touches a `VersionLabels` (every route is
async), so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict

from omni_core.serve.errors import ApiError

MAX_LABEL_CHARS = 256
MAX_LABELS_PER_STAGE = 64
MAX_VERSION = (1 << 63) - 1  # the wire's bound on a weights version (an int64)


def check_label(label: str, field: str) -> str:
    """A label as a client sent it, refused (422 naming `field`) beyond the bounds."""
    if not label or len(label) > MAX_LABEL_CHARS or not label.isprintable():
        raise ApiError(
            422,
            f"{field} must be 1 to {MAX_LABEL_CHARS} printable characters, got {len(label)} characters"
            + ("" if label.isprintable() else " with a control character"),
            kind="RequestValidationError",
            extra={"fields": [field]},
        )
    return label


def next_version(label: str | None, held: int) -> int:
    """The integer version an update labelled `label` commits on a stage holding `held`: the
    label's value when it is a decimal integer above `held`, else the next one."""
    if label is not None and label.isascii() and label.isdigit() and len(label) <= 19:
        value = int(label)
        if held < value <= MAX_VERSION:
            return value
    return held + 1


class VersionLabels:
    """Per stage: integer version -> the label a client gave it (bounded, newest kept)."""

    def __init__(self, stages: list[str]) -> None:
        self._labels: dict[str, OrderedDict[int, str]] = {name: OrderedDict() for name in stages}

    def set(self, stage: str, version: int, label: str | None) -> None:
        """Remember `label` for `version` (None: the integer is its own label)."""
        kept = self._labels[stage]
        kept.pop(version, None)
        if label is None or label == str(version):
            return
        kept[version] = label
        while len(kept) > MAX_LABELS_PER_STAGE:
            kept.popitem(last=False)

    def label(self, stage: str, version: int) -> str:
        return self._labels[stage].get(version, str(version))
