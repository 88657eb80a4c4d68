"""Megatron's logits of a model built by ``recipes.worker.setup``, gathered whole, to compare
with transformers' (tests/test_hf_import.py, tests/test_hf_import_moe.py)."""

from __future__ import annotations

import torch


def megatron_logits(model, tokens):
    """Full-vocabulary logits, float [b, s, padded vocab], of ``tokens`` (int [b, s]) on the
    last pipeline stage (None on the others): collective over the pipeline and tensor-parallel
    groups (every rank calls it)."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model.eval()
    inner = unwrap_model(model)
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], inner.config.hidden_size)
            torch.distributed.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
            inner.set_input_tensor(hidden)
        out = model(tokens, position_ids, None)
        if not parallel_state.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(),
                                   parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
