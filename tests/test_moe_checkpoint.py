"""MoE-era layout records and checkpoints written before them; no processes are started."""

from __future__ import annotations

import pytest
from compose import make_cfg

from gtp.records import LAYOUT_KEY, saved_layout, stored_layout
from recipes.validate import validate

# The keys part 1 of the MoE work added to every layout record.
NEW_KEYS = ("sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size",
            "expert_gtp_remat_size", "context_parallel_size")


@pytest.mark.parametrize("overrides", [("parallelism=tp2",), ("parallelism=tp1",)])
def test_a_record_from_before_the_expert_keys_is_the_same_layout(overrides):
    from recipes.checkpoint import layout_record

    now = layout_record(validate(make_cfg(*overrides), 2))
    old = {k: v for k, v in stored_layout(now).items() if k not in NEW_KEYS}
    assert len(old) == len(stored_layout(now)) - len(NEW_KEYS)
    back = saved_layout({LAYOUT_KEY: old})
    # pad_for_alignment comes from the gtp_layout record (absent here): compare the rest.
    assert {k: v for k, v in back.items()} == {k: v for k, v in now.items()
                                               if k != "pad_for_alignment"}


def test_a_record_with_the_expert_keys_keeps_them():
    from recipes.checkpoint import layout_record

    now = layout_record(validate(make_cfg("model=moe_tiny", "parallelism=tp2",
                                          "parallelism.sequence_parallel=true",
                                          "parallelism.expert_tensor_parallel_size=1"), 2))
    back = saved_layout({LAYOUT_KEY: stored_layout(now)})
    assert back["sequence_parallel"] is True and back["expert_tensor_parallel_size"] == 1
