"""gtp.muon on 2 gloo processes: a GTP-sharded weight's Muon update equals megatron's update of
the same logical (unpadded, unsharded) matrix, q/k/v split included; megatron-core 0.19.2's own
``TensorParallelMuon.orthogonalize`` (the patch taken out) fails that comparison by the padded
shape's scale factor.

The golden is megatron's unpatched path for a weight without GTP (what a ``gtp=off`` run does),
computed on every rank from the whole logical matrix; the patched path sees only this rank's
padded shard.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from multiproc import run_distributed


COLS = 24
# (rows, pad_length, is_qkv): 30 rows padded to 32 (16-row shards); a linear_qkv of 2 query
# groups of q 8, k 4, v 4 rows padded to 36 (18-row shards: no shard holds whole groups).
CASES = [(30, 2, False), (32, 4, True)]
QKV_SPLIT = [8, 4, 4]


def _muon(group):
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    pgs = types.SimpleNamespace(tp=None, expt_tp=None, gtp_remat=group, expt_gtp_remat=None)
    return TensorParallelMuon([torch.nn.Parameter(torch.zeros(2, 2))], split_qkv=True,
                              qkv_split_shapes=QKV_SPLIT, fp32_matmul_prec="highest",
                              is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                              pg_collection=pgs, tp_mode="duplicated")


def _param(shape, qkv, gtp_pad=None):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.is_qkv = qkv
    if gtp_pad is not None:
        p.is_gtp_weight_remat, p.pad_length = True, gtp_pad
    return p


def _worker(patched: bool):
    from gtp import muon

    (muon.install if patched else muon.uninstall)()
    group = torch.distributed.group.WORLD
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    opt = _muon(group)
    out = []
    for rows, pad, qkv in CASES:
        gen = torch.Generator().manual_seed(rows)
        logical = torch.randn(rows, COLS, generator=gen)
        padded = torch.nn.functional.pad(logical, (0, 0, 0, pad))
        shard_rows = padded.shape[0] // size
        shard = padded[rank * shard_rows:(rank + 1) * shard_rows].clone()
        with torch.no_grad():
            # megatron tags is_qkv on the shard's rows; gtp.muon.tag_qkv on the logical ones.
            shard_qkv = qkv and (patched or shard_rows % sum(QKV_SPLIT) == 0)
            mine = opt.orthogonalize(_param(shard.shape, shard_qkv, pad), shard)
            golden = opt.orthogonalize(_param(logical.shape, qkv), logical)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        torch.distributed.all_gather(gathered, mine.contiguous(), group=group)
        out.append((torch.cat(gathered), golden))
    muon.install()
    return out, (_egtp_groups() if patched else None)


def _egtp_groups():
    """Which grad-stats group gtp.muon gives each optimizer of a chain at EGTP 2 and EGTP 1:
    the group's global ranks, or the untouched placeholder's name."""
    from megatron.core import parallel_state as ps

    from gtp import muon

    seen = {}
    for egtp in (2, 1):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_gtp_remat_size=egtp)
        expert, dense = _param((4, 4), False), _param((4, 4), False)
        expert.allreduce = False  # megatron's tag of expert-parallel params
        chain = types.SimpleNamespace(chained_optimizers=[
            types.SimpleNamespace(optimizer=_muon_of([dense]), grad_stats_parallel_group="mp"),
            types.SimpleNamespace(optimizer=_muon_of([expert]), grad_stats_parallel_group="tp_ep_pp"),
            types.SimpleNamespace(optimizer=torch.optim.Adam([expert]),
                                  grad_stats_parallel_group="tp_ep_pp"),
        ])
        changed = muon._fix_expert_grad_stats_group(chain)
        seen[egtp] = (changed, [g if isinstance(g, str) else
                                torch.distributed.get_process_group_ranks(g)
                                for g in (o.grad_stats_parallel_group
                                          for o in chain.chained_optimizers)])
    ps.destroy_model_parallel()
    return seen


def _muon_of(params):
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    return TensorParallelMuon(params)


@pytest.fixture(scope="module")
def results():
    return run_distributed(_both, 2, timeout=180)[0]


def _both():
    """One world: megatron's own method (patch taken out), then the patched one."""
    return {False: _worker(False), True: _worker(True)}


def test_expert_muon_grad_norm_spans_the_egtp_group(results):
    """No MoE model here: a chain of a dense Muon, an expert Muon (params tagged
    ``allreduce=False``) and an expert Adam. At EGTP 2 only the expert Muon's group changes, to
    the expert tensor-model-pipeline group merged over EGTP (both ranks); at EGTP 1 none."""
    groups = results[True][1]
    assert groups[2] == (1, ["mp", [0, 1], "tp_ep_pp"])
    assert groups[1] == (0, ["mp", "tp_ep_pp", "tp_ep_pp"])


def _same_update(full: torch.Tensor, golden: torch.Tensor, rows: int) -> None:
    assert torch.count_nonzero(full[rows:]) == 0, "padding rows got an update"
    torch.testing.assert_close(full[:rows], golden, rtol=1e-5, atol=1e-6)


def test_gtp_shards_update_as_the_logical_matrix(results):
    for (full, golden), (rows, _, _) in zip(results[True][0], CASES):
        _same_update(full, golden, rows)


def test_megatron_0_19_2_scales_by_the_padded_shape(results):
    """The patch taken out: the comparison above fails (the scale fix is what passes it)."""
    (full, golden), (rows, pad, _) = results[False][0][0], CASES[0]
    with pytest.raises(AssertionError):
        _same_update(full, golden, rows)
    # spectral scale sqrt(max(1, rows / cols)): 32 padded rows instead of 30.
    ratio = float(full[:rows].norm() / golden.norm())
    assert ratio == pytest.approx(math.sqrt((rows + pad) / rows), rel=1e-4)
    # The q/k/v weight: megatron cannot split an 18-row shard and orthogonalizes it whole.
    (full, golden), (rows, _, _) = results[False][0][1], CASES[1]
    with pytest.raises(AssertionError):
        _same_update(full, golden, rows)


def test_main_param_copies_keep_the_gtp_padding_rows():
    """megatron's bf16 optimizers copy a GTP weight's tags onto its fp32 main param with
    ``tensor_parallel.copy_gtp_attributes``, which in 0.19.2 leaves out ``pad_length``: with
    gtp.muon installed the copy carries it (orthogonalize drops those rows), uninstalled not."""
    from megatron.core import tensor_parallel

    from gtp import muon

    source = _param((18, COLS), True, gtp_pad=4)
    for installed in (True, False):
        (muon.install if installed else muon.uninstall)()
        main = source.detach().clone().float()
        tensor_parallel.copy_gtp_attributes(main, source)
        assert main.is_gtp_weight_remat
        assert getattr(main, "pad_length", None) == (4 if installed else None)


def test_install_refuses_other_megatron_versions(monkeypatch):
    import megatron.core

    from gtp import muon

    monkeypatch.setattr(muon, "_PATCHED", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="0.19.2"):
        muon.install()


# ---- config and pre-launch checks (no processes) ----------------------------------------------

def test_optim_muon_composes_with_megatrons_field_names():
    from compose import make_cfg
    from recipes.run.optim import MUON_FIELDS, muon_fields
    from recipes.config.validate import validate

    cfg = make_cfg("optim=muon")
    parallel_dims = validate(cfg, 2)
    assert cfg.optim.optimizer == "muon" and parallel_dims.use_distributed_optimizer is False
    fields = muon_fields(cfg.optim)
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="muon", **fields)
    assert set(fields) == set(MUON_FIELDS)
    assert (config.muon_tp_mode, config.muon_fp32_matmul_prec) == ("duplicated", "highest")
    assert muon_fields(make_cfg().optim) == {}


@pytest.mark.parametrize("override, message", [
    ("optim.optimizer=sgd", r"optim.optimizer='sgd': valid are \('adam', 'muon'\)"),
    ("optim.muon_tp_mode=rowwise", r"optim.muon_tp_mode='rowwise': valid are"),
    ("optim.muon_fp32_matmul_prec=low", r"optim.muon_fp32_matmul_prec='low': valid are"),
    ("optim.muon_coefficient_type=cubic", r"optim.muon_coefficient_type='cubic': valid are"),
    ("optim.muon_num_ns_steps=0", r"optim.muon_num_ns_steps=0 must be >= 1"),
    ("optim.use_distributed_optimizer=true",
     r"optim.use_distributed_optimizer=true needs precision=bf16 \(precision.params_dtype="
     r"'fp32'.*set precision=bf16 or optim.use_distributed_optimizer=false"),
])
def test_bad_muon_settings_are_refused_before_launch(override, message):
    from compose import make_cfg
    from recipes.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=message):
        validate(make_cfg("optim=muon", override), 2)


def _parallel_dims(tp):
    return types.SimpleNamespace(tensor_model_parallel_size=tp)


def test_resume_across_optimizers_or_precisions_is_refused(tmp_path):
    from compose import make_cfg
    from ckpt.io import CheckpointError
    from recipes.checkpoint.policy import _check_optimizer
    from recipes.config.schema import to_dict

    adam_saved, muon_saved = to_dict(make_cfg()), to_dict(make_cfg("optim=muon"))
    with pytest.raises(CheckpointError, match=r"written by optim.optimizer=adam and this run is "
                       r"optim.optimizer=muon.*resume with optim=adam.*checkpoint.pretrained="):
        _check_optimizer(make_cfg("optim=muon"), _parallel_dims(1), adam_saved, {}, tmp_path)
    with pytest.raises(CheckpointError, match=r"written by optim.optimizer=muon and this run is "
                       r"optim.optimizer=adam"):
        _check_optimizer(make_cfg(), _parallel_dims(1), muon_saved, {}, tmp_path)
    # A checkpoint from before optim.optimizer was recorded is Adam's.
    del adam_saved["optim"]["optimizer"]
    with pytest.raises(CheckpointError, match="optim.optimizer=adam and this run"):
        _check_optimizer(make_cfg("optim=muon"), _parallel_dims(1), adam_saved, {}, tmp_path)
    with pytest.raises(CheckpointError, match=r"precision.params_dtype=fp32; changing it to bf16"):
        _check_optimizer(make_cfg("optim=muon", "precision=bf16"), _parallel_dims(1), muon_saved,
                         {}, tmp_path)
    _check_optimizer(make_cfg("optim=muon"), _parallel_dims(2), muon_saved,
                     {"tensor_model_parallel_size": 1}, tmp_path)  # duplicated: any TP


def test_blockwise_resume_at_another_tp_is_warned(tmp_path, capsys):
    from compose import make_cfg
    from recipes.checkpoint.policy import _check_optimizer
    from recipes.config.schema import to_dict

    saved = to_dict(make_cfg("optim=muon", "optim.muon_tp_mode=blockwise"))
    blockwise = make_cfg("optim=muon", "optim.muon_tp_mode=blockwise")
    _check_optimizer(blockwise, _parallel_dims(2), saved, {"tensor_model_parallel_size": 2},
                     tmp_path)
    assert capsys.readouterr().out == ""
    _check_optimizer(blockwise, _parallel_dims(1), saved, {"tensor_model_parallel_size": 2},
                     tmp_path)
    out = capsys.readouterr().out
    assert "warning: optim.muon_tp_mode=blockwise" in out and "tensor_model_parallel_size=1" in out
    assert "(saved at 2)" in out


def test_muon_fields_are_no_change_for_adam():
    """An Adam resume from a checkpoint recorded before the muon_* fields existed lists none of
    them; a Muon resume lists a changed one."""
    from compose import make_cfg
    from recipes.checkpoint.policy import resume_changes
    from recipes.config.schema import to_dict

    old = to_dict(make_cfg())
    for key in [k for k in old["optim"] if k.startswith("muon_")]:
        del old["optim"][key]
    assert [c.field for c in resume_changes(old, to_dict(make_cfg()), 0)] == []
    muon_now = to_dict(make_cfg("optim=muon", "optim.muon_num_ns_steps=6"))
    changes = {c.field: c.effect for c in resume_changes(to_dict(make_cfg("optim=muon")),
                                                           muon_now, 0)}
    assert changes == {"optim.muon_num_ns_steps": "used from now on"}


def test_distributed_muon_with_gtp_is_accepted_and_with_moe_refused_before_launch():
    from compose import make_cfg
    from recipes.config.validate import ConfigError, validate

    # tests/test_muon_distopt_e2e.py trains and resumes it.
    assert validate(make_cfg("optim=muon", "precision=bf16", "optim.use_distributed_optimizer=true",
                             "gtp=tp2_align16"), 2).gtp_remat_size == 2
    assert validate(make_cfg("optim=muon", "precision=bf16",
                             "optim.use_distributed_optimizer=true"), 2).use_distributed_optimizer
    with pytest.raises(ConfigError, match=r"an MoE model \(model.num_moe_experts=4\) is not "
                       r"supported"):
        validate(make_cfg("optim=muon", "precision=bf16", "optim.use_distributed_optimizer=true",
                          "model=moe_tiny", "checkpoint=none"), 2)


def test_muon_moe_resume_that_splits_or_joins_the_experts_goes_on(tmp_path):
    """Experts split (ep > 1, etp != tp, expert GTP) give megatron a Muon optimizer per expert
    kind, unsplit one: a Muon resume from one form to the other passes the pre-launch checks
    (tests/test_muon_moe_e2e.py and tests/test_moe_checkpoint_layouts.py load it)."""
    from compose import make_cfg
    from recipes.checkpoint.policy import _check_optimizer
    from recipes.config.schema import to_dict
    from recipes.config.validate import validate

    cfg = make_cfg("optim=muon", "model=moe_tiny")
    saved = to_dict(cfg)
    ep1 = {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1,
           "expert_tensor_parallel_size": 1, "expert_gtp_remat_size": 1}
    ep2 = {**ep1, "expert_model_parallel_size": 2}
    at_ep2 = validate(make_cfg("optim=muon", "model=moe_tiny",
                               "parallelism.expert_model_parallel_size=2"), 2)
    at_ep1 = validate(cfg, 2)
    for parallel_dims, saved_layout in ((at_ep2, ep1), (at_ep1, ep2), (at_ep2, ep2), (at_ep1, ep1)):
        _check_optimizer(cfg, parallel_dims, saved, saved_layout, tmp_path)
