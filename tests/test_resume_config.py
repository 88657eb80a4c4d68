"""What a resume takes from its checkpoint (recipes/checkpoint/policy.py), without training:
the resume diff (every changed field named, data changes refused, parallelism changes with
their effect), extended train_iters, the checkpoint's model and data unless given, a saved
config that is not plain data, a Hugging Face import given as a load."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from compose import make_cfg

from ckpt.io import CheckpointError
from recipes.checkpoint import policy as checkpointer


# --- 4. the resume diff ---------------------------------------------------------------------

def test_resume_diff_names_every_change_and_refuses_data_changes():
    from recipes.config.schema import to_dict

    saved = to_dict(make_cfg())
    now = to_dict(make_cfg("optim.lr=5e-4", "train.train_iters=1000", "train.seed=7",
                           "data.global_batch_size=32", "parallelism=tp2", "train.log_interval=5"))
    changes = {c.field: c for c in checkpointer.resume_changes(saved, now, consumed_samples=48)}
    assert set(changes) == {"optim.lr", "optim.lr_decay_iters", "train.train_iters", "train.seed",
                            "data.global_batch_size", "train.log_interval",
                            "parallelism.tensor_model_parallel_size"}, sorted(changes)
    assert "resharded" in changes["parallelism.tensor_model_parallel_size"].effect
    assert changes["optim.lr"].effect.startswith("checkpoint's 0.003 kept")
    assert changes["train.seed"].effect.startswith("REFUSED")
    assert changes["data.global_batch_size"].effect.startswith("REFUSED: 48 consumed samples")
    assert "keep their order" in changes["train.train_iters"].effect
    table = checkpointer.format_changes(list(changes.values()))
    assert "optim.lr" in table and "0.0005" in table
    ok = checkpointer.resume_changes(saved, to_dict(make_cfg("data.global_batch_size=32")), 64)
    assert not ok[0].effect.startswith("REFUSED")
    override = to_dict(make_cfg("optim.lr=5e-4", "optim.override_opt_param_scheduler=true"))
    lr = next(c for c in checkpointer.resume_changes(saved, override, 0) if c.field == "optim.lr")
    assert lr.effect.startswith("new value used")



def test_only_fields_that_shape_tensors_are_said_to_be_checked_against_them():
    """A loss coefficient changes the training from the resume on; a size is checked against
    the checkpoint's tensors (the family's shape fields, recipes.config.shape_fields)."""
    from recipes.config.schema import to_dict

    saved = to_dict(make_cfg("model=qwen3_next_tiny", "parallelism=dp2"))
    now = to_dict(make_cfg("model=qwen3_next_tiny", "parallelism=dp2",
                           "model.moe_aux_loss_coeff=0.01", "model.hidden_size=64",
                           "model.num_moe_experts=8"))
    effects = {c.field: c.effect for c in checkpointer.resume_changes(saved, now, 0)}
    assert effects["model.moe_aux_loss_coeff"] == "used from now on", effects
    tensors = "checked against the checkpoint's tensors at load"
    assert effects["model.hidden_size"] == effects["model.num_moe_experts"] == tensors, effects

def test_a_data_field_the_checkpoint_does_not_record_is_named_as_unrecorded():
    """A run config without the model section (an edited checkpoint): model.seq_length is
    refused as not recorded, not as a change from None."""
    from recipes.config.schema import to_dict

    saved = {k: v for k, v in to_dict(make_cfg()).items() if k != "model"}
    changes = {c.field: c for c in checkpointer.resume_changes(saved, to_dict(make_cfg()), 0)}
    effect = changes["model.seq_length"].effect
    assert effect.startswith("REFUSED: not recorded in the checkpoint"), effect


@pytest.mark.parametrize("overrides, effect", [
    (("parallelism.pipeline_model_parallel_size=2",), "resharded"),
    (("parallelism.context_parallel_size=2",), "resharded"),
    (("model=moe_tiny", "parallelism.expert_model_parallel_size=2"), "resharded"),
    (("model=moe_tiny", "parallelism.expert_tensor_parallel_size=1"), "resharded"),
    (("parallelism.data_parallel_size=4",), "data.global_batch_size"),
    (("parallelism.sequence_parallel=true",), "no effect on the saved state"),
    (("gtp=tp2_align16",), "resharded"),
    (("parallelism.nproc_per_node=4",), "processes started"),
])
def test_resume_diff_lists_every_parallelism_field_with_its_effect(overrides, effect):
    """The layout fields are in the table too (docs/resume.md: every field that differs)."""
    from recipes.config.schema import to_dict

    base = [o for o in overrides if o.startswith("model=")]
    saved, now = to_dict(make_cfg(*base)), to_dict(make_cfg(*overrides))
    changes = {c.field: c for c in checkpointer.resume_changes(saved, now, consumed_samples=0)}
    layout_fields = [f for f in changes if f.startswith(("parallelism.", "gtp."))]
    assert layout_fields, sorted(changes)
    for field in layout_fields:
        assert changes[field].effect != "used from now on", (field, changes[field].effect)
    assert any(effect in changes[f].effect for f in layout_fields), \
        {f: changes[f].effect for f in layout_fields}


def test_extending_train_iters_keeps_the_planned_samples_in_order(data_cache):
    from recipes import data as D

    # Batches of 4000 samples: 2 iterations span two epochs of the corpus (7645 samples of 64
    # tokens), 10 iterations six, and megatron shuffles over all epochs but the last.
    def cfg(iters):
        return make_cfg(f"data.cache_dir={data_cache}", f"train.train_iters={iters}",
                        "data.global_batch_size=4000", "data.micro_batch_size=4")

    plan = checkpointer.planned_samples({"consumed_samples": 4000}, 1, None, cfg(2))
    assert plan == [8000]
    extended = checkpointer.planned_samples({"consumed_samples": 4000, "data_plan": plan}, 1,
                                            None, cfg(10))
    assert extended == [8000, 32000]

    def samples(c, p):
        it = D.build_train_iterator(c, 4000, 0, 1, plan=p)
        return torch.cat([next(it)["tokens"] for _ in range(8)])

    before = samples(cfg(2), plan)
    assert torch.equal(samples(cfg(10), extended), before)
    # What the plan prevents: a dataset sized for 10 iterations gives other samples.
    assert not torch.equal(samples(cfg(10), None), before)


def test_a_resume_takes_the_checkpoints_model_and_data_unless_given():
    """``checkpoint.load=DIR`` alone: every model and data field comes from the checkpoint's
    run (a fine-tune's model from its source, its ``data=text data.paths=[...]``; issue 58 item
    6), but the cache dir; a given field keeps its value (the shape check or prepare_resume
    refuses it later); ``model=NAME`` keeps the whole group, ``experiment=NAME`` both groups,
    one given tokenizer field all three."""
    saved = {"model": {"name": "src", "num_layers": 4, "hidden_size": 72, "qk_layernorm": True,
                       "not_a_field": 1},
             "data": {"tokenizer": "/src", "eod_id": 0, "global_batch_size": 99,
                      "name": "text", "source": "text", "paths": ["/d/a.txt"],
                      "cache_dir": "/other/machine"}}
    plan = SimpleNamespace(path="/ck/iter_0000002",
                           common={"train_state": {"config": saved}})

    def take(*overrides):
        cfg = make_cfg(*overrides)
        return cfg, checkpointer.take_checkpoint_fields(cfg, plan, overrides=list(overrides))

    cfg, note = take()
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.qk_layernorm) == (4, 72, True)
    assert (cfg.data.tokenizer, cfg.data.eod_id, cfg.model.name) == ("/src", 0, "src")
    assert (cfg.data.global_batch_size, cfg.data.source, list(cfg.data.paths)) == (
        99, "text", ["/d/a.txt"]) and "not_a_field" not in cfg.model
    assert cfg.data.cache_dir == make_cfg().data.cache_dir
    assert note.startswith("> from /ck/iter_0000002 (not given here): model.num_layers=4")
    assert "model.qk_layernorm=true" in note and "model.name" not in note  # Hydra's spelling
    assert "data.paths=[/d/a.txt]" in note and "data.global_batch_size=99" in note
    cfg, _ = take("model.hidden_size=96", "data.tokenizer=byte", "data.paths=[/d/b.txt]")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.data.tokenizer) == (96, 4, "byte")
    assert cfg.data.eod_id is None  # another tokenizer: not the checkpoint's end of document
    assert (list(cfg.data.paths), cfg.data.source) == (["/d/b.txt"], "text")
    cfg, _ = take("model=llama_tiny")
    assert cfg.model.num_layers == make_cfg("model=llama_tiny").model.num_layers != 4
    assert cfg.data.tokenizer == "/src"
    cfg, _ = take("data=pydoc")
    assert cfg.data == make_cfg("data=pydoc").data
    experiment = "experiment=" + _an_experiment()
    cfg, note = take(experiment)
    assert note is None and cfg == make_cfg(experiment)
    assert checkpointer.take_checkpoint_fields(make_cfg(), None, overrides=[]) is None


@pytest.mark.parametrize("config, match", [
    ({"model": {"num_layers": [2]}}, r"model.num_layers=\[2\], not a valid value"),
    ({"model": {"swiglu": "maybe"}}, r"model.swiglu='maybe', not a valid value"),
    ({"model": {"name": "${oc.env:HOME}"}}, r"model.name='\$\{oc.env:HOME\}': not a plain value"),
    ({"data": {"tokenizer": None}}, r"data.tokenizer=None, not a valid value"),
    ({"model": {"normalization": {"a": 1}}}, r"not a plain value"),
    ({"model": "tiny"}, r"run config's model is a str, not a mapping"),
    (["a"], r"run config's train_state.config is a list, not a mapping"),
])
def test_a_saved_config_that_is_not_plain_data_is_refused_naming_the_field(config, match):
    """A checkpoint is data: a saved value of the wrong type or an OmegaConf interpolation
    (which would run at resolve time, e.g. copy an environment variable) is one CheckpointError
    naming the field, never a traceback or a resolved lookup."""
    from omegaconf import OmegaConf

    from recipes.config.schema import Config

    typed = OmegaConf.merge(OmegaConf.structured(Config), make_cfg())  # as train.py's is
    plan = SimpleNamespace(path="/ck/iter_0000002", common={"train_state": {"config": config}})
    with pytest.raises(CheckpointError, match=match):
        checkpointer.take_checkpoint_fields(typed, plan, overrides=[])


def test_loading_a_hugging_face_import_is_refused_pointing_to_pretrained():
    plan = SimpleNamespace(path="/imp/iter_0000000", common={
        "hf_imported_from": {"source": "/hf"}, "train_state": {"config": {"model": {}}}})
    with pytest.raises(CheckpointError, match=r"load: /imp/iter_0000000 is an import of a "
                                              r"Hugging Face model.*"
                                              r"checkpoint.pretrained=/imp instead"):
        checkpointer.take_checkpoint_fields(make_cfg(), plan, overrides=[])


def _an_experiment() -> str:
    return sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "experiment").glob(
        "*.yaml"))[0]
