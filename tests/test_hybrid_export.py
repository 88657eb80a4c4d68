"""``python -m gtp export`` of a hybrid Mamba checkpoint (``model=hybrid_tiny``) to transformers'
``NemotronHForCausalLM``: the exported model's logits are megatron's.

In a 4-process world the model is built through the recipe at tp2 x g2/a16 (Mamba's packed
``in_proj`` GTP-sharded with the boundary inside ``x``, 13 padding rows after ``dt``) and at tp1
with tied embeddings, the tanh GeLU and an MLP layer first (exported with ``use_cache`` false:
transformers 5.25's cache fails on it). Every weight is set from a full random tensor seeded by
its global name (cut to the rank as megatron shards it: tests/helpers/layout_goldens.py), so
each norm, ``A_log``, ``D`` and ``dt_bias`` differs from every other and a weight mapped to the
wrong place changes the logits. The model computes the logits of a fixed batch (gathered over
TP) and saves through ``ckpt.io``; the test exports each checkpoint and runs the
batch through transformers. Both sides are fp32; the bound is the GPT export's (1e-4).

The tp2 x g2/a16 model is also saved in megatron-core 0.19.2's stock format, model only, by
megatron's own writer (the stock format cannot hold this model's optimizer under GTP:
docs/hybrid.md): ``out_proj``, ``linear_proj``, ``linear_fc2`` and the output layer padded,
``in_proj`` gathered and split. The stock reader gives the logical checkpoint's tensors from it,
every one exactly, and it exports the same logits.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from ckpt import cli
from hf_checks import megatron_logits
from layout_goldens import build, full_shape, global_names, local, make_cfg
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
VOCAB = 257
LOGITS_ATOL = 1e-4
LAYOUTS = {
    "tp2g2a16": (2, 2, 16, ()),
    # An MLP layer first: transformers 5.25's NemotronH cache fails, the export turns it off.
    "tp1_tied_tanh": (1, 1, None, ("model.share_embeddings_and_output_weights=true",
                                   "model.openai_gelu=true", "model.hybrid_layer_pattern=-M*-M*")),
}
BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
STOCK_OF = "tp2g2a16"  # also saved in the stock format, as "<name>_stock"


def _random_full(name: str, shape: tuple) -> torch.Tensor:
    """A full logical tensor seeded by ``name`` (the same on every rank): norms around 1,
    other weights of a trained model's scale."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1 + 0.3 * t
    return 0.5 * t if name.endswith(("A_log", "D", "dt_bias")) else 0.1 * t


def _save_stock_model(root: str, model, common: dict, record: dict) -> None:
    """The model as stock megatron-core 0.19.2 saves it without its optimizer (megatron's
    ``sharded_state_dict`` and ``dist_checkpointing.save``), with the run config and layout
    records ``gtp export`` reads."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from ckpt.format import logical_format
    from ckpt.format.records import stored_layout
    from ckpt.io.state import model_sharded_state_dict

    logical_format.configure("stock")
    try:
        state = model_sharded_state_dict(model)
        # No sharding record (megatron writes none): the reader takes the layout from the
        # layout record and the run config, and the GTP weights from the families' patterns.
        state = {"model": state, "iteration": 1, "train_state": common,
                 "layout": stored_layout(record)}
        path = Path(root) / "iter_0000001"
        if torch.distributed.get_rank() == 0:
            path.mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state, str(path))
        if torch.distributed.get_rank() == 0:
            (Path(root) / "latest_checkpointed_iteration.txt").write_text("1")
    finally:
        logical_format.configure("logical")


def _world(root: str, cfgs: dict) -> dict:
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from ckpt import io as checkpoint

    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = build(cfg_yaml)
        with torch.no_grad():
            for pname, p in global_names(model).values():
                p.copy_(local(_random_full(pname, full_shape(p)), p, pname, cfg))
        common = {"consumed_samples": 0, "config": OmegaConf.to_container(cfg)}
        checkpoint.save_checkpoint(f"{root}/{name}", 1, model, opt, sched, common, record)
        if name == STOCK_OF:
            _save_stock_model(f"{root}/{name}_stock", model, common, record)
        out[name] = {"tokens": tokens, "logits": megatron_logits(model, tokens)}
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_export")
    cfgs = {name: make_cfg("hybrid_tiny", tp, g, pad, WORLD, "logical", *extra)
            for name, (tp, g, pad, extra) in LAYOUTS.items()}
    return root, run_distributed(_world, WORLD, str(root), cfgs, timeout=600)[0]


def test_the_stock_format_reads_as_the_logical_one_every_tensor_exactly(world):
    from ckpt import stock

    root, _ = world
    analysis, got = stock.read_logical(root / f"{STOCK_OF}_stock")
    assert analysis.format == "stock" and analysis.stock  # padded rows were there to drop
    assert analysis.tensors["decoder.layers.0.mixer.out_proj.weight"].stored_shape == (64, 96)
    _, want = stock.read_logical(root / STOCK_OF)
    want = {k: v for k, v in want.items() if not k.startswith("optimizer")
            and isinstance(v, torch.Tensor)}
    assert "decoder.layers.3.mixer.in_proj.weight.x" in want and len(want) == 49
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("name", [*LAYOUTS, f"{STOCK_OF}_stock"])
def test_nemotron_h_export_logits_equal_megatron(world, tmp_path, name):
    from transformers import AutoModelForCausalLM, NemotronHForCausalLM

    root, res = world
    out = tmp_path / "hf"
    assert cli.main(["export", str(root / name), str(out)]) == 0
    name = name.removesuffix("_stock")  # the stock file holds the same model
    config = json.loads((out / "config.json").read_text())
    pattern = "-M*-M*" if "tanh" in name else "M*-M*-"
    assert config["layers_block_type"] == [BLOCKS[s] for s in pattern]
    assert config["mlp_hidden_act"] == ("gelu_pytorch_tanh" if "tanh" in name else "gelu")
    notes = json.loads((out / "gtp_recipes_export.json").read_text())["notes"]
    assert config["use_cache"] == (notes is None) == (pattern[0] == "M")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    assert isinstance(model, NemotronHForCausalLM)
    assert model.model.layers[pattern.index("M")].mixer.in_proj.weight.shape == (230, 48)
    with torch.no_grad():  # the model's own generation settings: use_cache as exported
        hf = model(res[name]["tokens"]).logits
        assert model.generate(res[name]["tokens"][:1, :8], max_new_tokens=2,
                              do_sample=False).shape == (1, 10)
    megatron = res[name]["logits"]
    assert megatron.shape == (2, 64, 320) and hf.shape == (2, 64, VOCAB)
    diff = (hf - megatron[..., :VOCAB]).abs().max().item()
    assert diff <= LOGITS_ATOL, (name, diff)
    assert megatron[..., :VOCAB].std() > 0.1  # not a degenerate model: the bound means something
