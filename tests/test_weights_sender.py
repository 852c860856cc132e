"""WeightSender refuses, by name, a tensor whose dtype the wire cannot name (msgspec checks a
struct's fields on decode only, so the sender checks what it builds)."""

from __future__ import annotations

import pytest
import torch

from omni_core.weights_sender import WeightSender, WeightSenderError


@pytest.mark.parametrize("share", ["shm", "collective"])
def test_a_dtype_the_wire_has_no_name_for_is_refused_naming_the_tensor(share: str, tmp_path) -> None:
    tensors = {"ok": torch.zeros(2), "odd": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(WeightSenderError, match=r"tensor 'odd' is complex64, a dtype the wire has no name for"):
        if share == "shm":
            with WeightSender(shm_dir=tmp_path) as sender:
                sender.share(tensors)
        else:
            WeightSender.collective_source(tensors)


def test_wire_dtypes_keep_torch_s_names() -> None:
    source = WeightSender.collective_source({"b": torch.zeros(1, dtype=torch.bfloat16), "i": torch.zeros(1).int()})
    assert [(spec.name, spec.dtype) for spec in source.tensors] == [("b", "bfloat16"), ("i", "int32")]
