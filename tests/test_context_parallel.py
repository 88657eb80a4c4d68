"""Context parallelism (recipes/model/context_parallel.py): refused before launch without
TransformerEngine; with it (a stand-in module), passed to megatron's parallel_state and
TransformerConfig, each micro-batch split as megatron's 2 x CP zigzag and the loss averaged over
the whole sequence. Goldens are computed here by plain indexing and sums, not by the code under
test."""

from __future__ import annotations

import math
import sys

# Imported before the TE stand-in is installed: megatron probes TransformerEngine on import.
import megatron.core.transformer  # noqa: F401
import pytest
import torch
from compose import make_cfg

from recipes.model import context_parallel
from recipes.dry_run import activation_bytes, report
from recipes.model.build import transformer_config
from recipes.config.validate import ConfigError, validate


@pytest.fixture
def no_te(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)


@pytest.mark.parametrize("model", ["model=tiny", "model=moe_tiny"])
def test_refused_without_transformer_engine(no_te, model):
    with pytest.raises(ConfigError) as info:
        validate(make_cfg(model, "parallelism=tp1", "parallelism.context_parallel_size=2"), 2)
    message = str(info.value)
    assert "parallelism.context_parallel_size=2 needs TransformerEngine" in message, message
    assert "TEDotProductAttention" in message and "context_parallel_size=1" in message, message


def test_sequence_must_split_into_2cp_chunks(stand_in_te):
    cfg = make_cfg("parallelism=tp1", "parallelism.context_parallel_size=4",
                   "model.seq_length=36")  # 36 = 4 x 9: not a multiple of 2 x 4
    with pytest.raises(ConfigError) as info:
        validate(cfg, 4)
    assert "model.seq_length=36 is not divisible by 2 x parallelism.context_parallel_size=8" \
        in str(info.value), str(info.value)


def test_passed_to_parallel_state_and_transformer_config(stand_in_te):
    cfg = make_cfg("parallelism=tp2", "parallelism.context_parallel_size=2",
                   "parallelism.sequence_parallel=true")
    assert cfg.parallelism.nproc_per_node == 4  # tp2 x cp2 x dp1
    parallel_dims = validate(cfg, 8)
    # dp = 8 / (tp2 x cp2)
    assert (parallel_dims.context_parallel_size, parallel_dims.data_parallel_size) == (2, 2)
    assert "tp2+sp x cp2 x dp2 (world 8)" in parallel_dims.describe(), parallel_dims.describe()
    fields = parallel_dims.megatron_kwargs()
    assert (fields["context_parallel_size"], fields["tensor_model_parallel_size"]) == (2, 2)
    config = transformer_config(cfg, parallel_dims, use_te=True)
    assert config.context_parallel_size == 2 and config.transformer_impl == "transformer_engine"
    assert validate(make_cfg("parallelism=tp2"), 2).megatron_kwargs()["context_parallel_size"] == 1
    with pytest.raises(ConfigError) as info:  # world 6: not a multiple of tp2 x cp2
        validate(cfg, 6)
    assert "context_parallel_size=2" in str(info.value), str(info.value)


def _zigzag_golden(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` equal chunks along dim 1."""
    n = x.shape[1] // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([x[:, first * n:(first + 1) * n], x[:, second * n:(second + 1) * n]], dim=1)


@pytest.mark.parametrize("cp", [2, 4])
def test_batch_split_is_the_2cp_zigzag(monkeypatch, cp):
    b, s = 3, 32
    tokens = torch.arange(b * s).view(b, s)
    batch = {"tokens": tokens, "labels": tokens + 10_000,
             "loss_mask": (tokens % 5 != 0).float(),
             "position_ids": torch.arange(s).expand(b, s).clone()}
    before = {k: v.clone() for k, v in batch.items()}
    seen = []
    for rank in range(cp):
        # megatron's split asks torch.distributed for the CP group's size and this rank.
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        mine = context_parallel.batch_on_this_rank(batch, cp_group=object())
        for key, value in before.items():
            assert torch.equal(mine[key], _zigzag_golden(value, cp, rank)), (cp, rank, key)
            assert mine[key].shape == (b, s // cp)
        seen.append(mine["position_ids"][0])
        assert all(torch.equal(batch[k], before[k]) for k in before)  # the caller's batch kept
    # Every position exactly once over the CP ranks.
    assert sorted(torch.cat(seen).tolist()) == list(range(s))


def test_loss_is_the_whole_sequence_mean(monkeypatch):
    cp, b, s = 2, 2, 16
    gen = torch.Generator().manual_seed(0)
    per_token = torch.rand(b, s, generator=gen, dtype=torch.float64) * 5
    mask = (torch.rand(b, s, generator=gen) > 0.3).double()
    mask[:, : s // 4] = 0  # rank 0's first chunk mostly masked: unequal token counts per rank
    whole = float((per_token * mask).sum() / mask.sum())
    n = s // (2 * cp)
    shares = [torch.cat([torch.arange(r * n, (r + 1) * n),
                         torch.arange((2 * cp - 1 - r) * n, (2 * cp - r) * n)]) for r in range(cp)]
    totals = torch.tensor([float((per_token * mask).sum()), float(mask.sum())])
    # all_reduce over the CP group: every rank ends with the sums of all ranks.
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, group=None: t.copy_(totals.to(t.dtype)))
    losses, grads = [], torch.zeros(b, s, dtype=torch.float64)
    for idx in shares:
        out = per_token[:, idx].clone().requires_grad_(True)
        loss, reported = context_parallel.loss_over_cp(mask[:, idx], out, cp_group=None)
        assert math.isclose(float(reported), whole, rel_tol=1e-6), (float(reported), whole)
        loss.backward()
        grads[:, idx] = out.grad.double()
        losses.append(float(loss))
    # megatron multiplies each rank's loss by cp and DDP averages over the cp ranks: the sum of
    # the ranks' losses is the whole mean, and so is the gradient.
    assert math.isclose(sum(losses), whole, rel_tol=1e-6), (losses, whole)
    assert torch.allclose(grads, mask / mask.sum(), rtol=1e-6, atol=0)


def test_dry_run_with_context_parallelism(stand_in_te, capsys):
    base = ("parallelism=tp1", "model.recompute_granularity=selective")
    cfg1 = make_cfg(*base)
    cfg2 = make_cfg(*base, "parallelism.context_parallel_size=2")
    l1, l2 = validate(cfg1, 2), validate(cfg2, 4)
    # Every activation term is linear in the tokens a rank holds (no s^2 term: selective).
    a1, a2 = activation_bytes(cfg1, l1, 128), activation_bytes(cfg2, l2, 128)
    assert abs(a2 - a1 / 2) <= 1, (a1, a2)
    text = report(cfg2, l2)
    assert "cp2" in text and f"{cfg2.model.seq_length // 2} tokens of each sequence per rank" \
        in text, text
