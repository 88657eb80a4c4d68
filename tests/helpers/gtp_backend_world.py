"""The multi-process half of tests/test_gtp_backend.py: a tiny GPTModel trained on 4 gloo ranks at
each GTP layout, the backend's collectives counted and checked against goldens, and the
peer exchange (:func:`all_workers`, one world).

Multi-process tests run a tiny GPTModel (local spec, fp32, CPU init, hidden 72, ffn 200, vocab
272) on 4 gloo ranks. Dims were chosen so that GTP padding is non-zero and, at g4/a32, a rank
holds only padding (linear_proj/linear_fc2: L=72 -> 32,32,8,0 rows; vocab: L=272 -> 96,96,80,0).
The vocab is a multiple of 8*tp for tp in {1, 2}, so megatron adds no vocab padding and every
layout computes over the same logits.
"""

from __future__ import annotations

import torch

from multiproc import reset_model_parallel

WORLD = 4
VOCAB = 272
SEQ = 32
GLOBAL_BATCH = 16
MICRO_BATCHES = 2
STEPS = 3
LR = 1e-3

# (tp, g, pad_for_alignment); the first is the reference, (2, 1, 1) the g=1 baseline at TP=2.
LAYOUTS = [(1, 1, 1), (1, 2, 16), (1, 4, 32), (2, 1, 1), (2, 2, 16), (1, 2, 1)]
# The same GTP layouts with megatron's overlap on (weight prefetch, async reduce-scatter).
OVERLAP_LAYOUTS = [(1, 2, 16, "overlap"), (1, 4, 32, "overlap"), (2, 2, 16, "overlap")]


# --------------------------------------------------------------------------------------------
# Helpers that run inside the worker processes.
# --------------------------------------------------------------------------------------------
def _build(tp, g, pad, calculate_per_token_loss=False):
    """(model, ddp, config) for one layout, after (re)initializing megatron's process groups."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.transformer import TransformerConfig

    from gtp import alignment, backend
    from mcore_compat import cpu as cpu_compat

    cpu_compat.install()
    assert backend.install() is True
    # The previous layout's GTP chains and buffer tickets, and its process groups (reused by
    # this layout where megatron asks for the same ranks; a fresh set per layout would pile up).
    reset_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, gtp_remat_size=g)
    # The recipe order: megatron's hook, then our alignment override, then the model.
    gtp_api.configure_gtp_remat_from_recipe(calculate_per_token_loss=calculate_per_token_loss)
    alignment.apply_pad_for_alignment(pad)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=72, num_attention_heads=4, ffn_hidden_size=200,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=torch.float32,
        gtp_weight_remat_size=g, hidden_dropout=0.0, attention_dropout=0.0,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=64)
    ddp = DDP(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    if g > 1:
        gtp_api.classify_gtp_remat_chains([ddp])
        assert alignment.check_pad_applied(model, pad) > 0
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return model, ddp, cfg


def gtp_mod():
    from megatron.core.tensor_parallel import generalized_tensor_parallelism

    return generalized_tensor_parallelism


def _gather_gtp(p):
    """All-gather a GTP shard with plain torch.distributed (independent of the backend)."""
    out = torch.empty((p.shape[0] * p.group.size(), *p.shape[1:]), dtype=p.dtype)
    torch.distributed.all_gather_into_tensor(out, p.detach().contiguous(), group=p.group)
    return out


def _logical_full(model):
    """{name: the full logical tensor}: GTP shards gathered, padding stripped, TP gathered.

    Also returns the largest |value| found in any GTP padding row (must stay 0).
    """
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    full, pad_max = {}, 0.0
    for name, p in model.named_parameters():
        t = p.detach()
        if gtp_mod().is_gtp_param(p):
            gathered = _gather_gtp(p)
            logical = p._unsharded_shape[0]
            if logical < gathered.shape[0]:
                pad_max = max(pad_max, gathered[logical:].abs().max().item())
            t = gathered[:logical]
        if getattr(p, "tensor_model_parallel", False) and tp_group.size() > 1:
            parts = [torch.empty_like(t) for _ in range(tp_group.size())]
            torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=p.partition_dim)
        full[name] = t.clone()
    return full, pad_max


@torch.no_grad()
def _load_logical(model, full):
    """Set every param to its slice of ``full`` (TP split, then megatron's GTP pad + shard)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        t = full[name]
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            t = t.chunk(tp, dim=p.partition_dim)[tp_rank]
        if gtp_mod().is_gtp_param(p):
            t = torch.nn.functional.pad(t, (0, 0, 0, p.pad_length))
            rows = p.shape[0]
            t = t[p.group.rank() * rows:(p.group.rank() + 1) * rows]
        p.copy_(t)


def _batch(step):
    """This rank's micro-batches of the global batch of ``step`` (same for every layout)."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    # Data-distribution group: replicate DP x gtp_remat (GTP peers read different samples).
    dp = ps.get_data_parallel_world_size(with_gtp_remat=True)
    dp_rank = ps.get_data_parallel_rank(with_gtp_remat=True)
    per_rank = GLOBAL_BATCH // dp
    mine = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [(m[:, :-1], m[:, 1:]) for m in mine.chunk(MICRO_BATCHES)]


def _train_step(ddp, opt, step):
    """One megatron step; returns (global mean lm loss, grad norm, replicated-grad spread)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro = iter(_batch(step))

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(o):
            loss = o.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # megatron divides loss in place

        return out, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro, model=[ddp],
        num_microbatches=MICRO_BATCHES, seq_length=SEQ,
        micro_batch_size=GLOBAL_BATCH // ps.get_data_parallel_world_size() // MICRO_BATCHES,
        forward_only=False,
    )
    # finalize_model_grads reduced replicated (non-GTP) grads over the gtp_remat group: every
    # GTP peer must now hold the same grad for them.
    spread = 0.0
    gtp_group = ps.get_gtp_weight_remat_group()
    for p in ddp.module.parameters():
        if gtp_group.size() > 1 and not gtp_mod().is_gtp_param(p):
            parts = [torch.empty_like(p.main_grad) for _ in range(gtp_group.size())]
            torch.distributed.all_gather(parts, p.main_grad.contiguous(), group=gtp_group)
            spread = max(spread, max((q - parts[0]).abs().max().item() for q in parts))
    _, grad_norm, _ = opt.step()
    loss = torch.stack([d["lm loss"] for d in losses]).mean().reshape(1)
    dp_group = ps.get_data_parallel_group(with_gtp_remat=True)
    torch.distributed.all_reduce(loss, group=dp_group)
    return loss.item() / dp_group.size(), grad_norm, spread


def _invariance_worker():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gtp import backend

    rank = torch.distributed.get_rank()
    assert torch.distributed.get_world_size() == WORLD
    gtp = gtp_mod()
    reference = None
    report = {}
    for tp, g, pad, *overlap in LAYOUTS + OVERLAP_LAYOUTS:
        model, ddp, _ = _build(tp, g, pad)
        counts = {"ag": 0, "rs": 0}
        if overlap:
            # megatron's deferred weight-gradient reduce-scatters, as recipes.model.gtp_setup turns
            # them on; counted through the backend (async_op=True calls only).
            gtp.update_gtp_config(async_reduction=True)
            gtp.classify_gtp_remat_chains(model)  # a fresh chain for the rebuilt model
            gtp.gather_along_first_dim = _counting(backend._gather_along_first_dim, counts,
                                                   "ag", only_async=True)
            gtp.reduce_scatter_along_first_dim = _counting(
                backend._reduce_scatter_along_first_dim, counts, "rs", only_async=True)
        if reference is None:
            reference, _ = _logical_full(model)  # megatron's own init of the (tp1, g1) model
        _load_logical(model, reference)
        start, pad_max0 = _logical_full(model)
        assert pad_max0 == 0.0
        assert all(torch.equal(start[k], reference[k]) for k in reference), "load is not exact"
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, clip_grad=1.0, bf16=False, fp16=False),
            [ddp],
        )
        try:
            history = [_train_step(ddp, opt, step) for step in range(STEPS)]
        finally:
            gtp.update_gtp_config(weight_prefetch=False, async_reduction=False)
            gtp.gather_along_first_dim = backend._gather_along_first_dim
            gtp.reduce_scatter_along_first_dim = backend._reduce_scatter_along_first_dim
        final, pad_max = _logical_full(model)
        cache = gtp.get_global_GTP_cache()
        gathers = [s for s in cache._slots.values() if not s.reduce_scatter and s.buf is not None]
        report[(tp, g, pad, *overlap)] = {
            # Distinct all-gather buffers alive after the steps, and distinct (shape, dtype) keys.
            "ag_buffers": len({id(s.buf) for s in gathers}),
            "ag_keys": len({s.key for s in gathers}),
            "async": counts,
            "loss": [h[0] for h in history], "grad_norm": [h[1] for h in history],
            "spread": max(h[2] for h in history), "pad_max": pad_max,
            "final": final if rank == 0 else None,
            "n_gtp": sum(gtp_mod().is_gtp_param(p) for p in model.parameters()),
        }
    return report


def _counting(fn, counter, key, only_async=False):
    def wrapped(*args, **kwargs):
        counter[key] += not only_async or bool(kwargs.get("async_op"))
        return fn(*args, **kwargs)

    return wrapped


def _backend_worker():
    """For each GTP layout, against an identically seeded g=1 model at the same TP."""
    from megatron.core.tensor_parallel import gtp_api
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # noqa: F401

    from gtp import alignment, backend, shards

    assert torch.distributed.get_world_size() == WORLD
    gtp = gtp_mod()
    out = {}
    for tp, g, pad in [(1, 2, 16), (1, 4, 32), (2, 2, 16)]:
        ref_model, _, _ = _build(tp, 1, pad)
        ref = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
        model, ddp, _ = _build(tp, g, pad)
        assert gtp.gather_along_first_dim is backend._gather_along_first_dim
        assert gtp_api.HAVE_GTP and not gtp.HAVE_TE
        assert not gtp.GTP_CONFIG.weight_prefetch and not gtp.GTP_CONFIG.async_reduction
        checked, empty_shards = 0, 0
        for name, p in model.named_parameters():
            if not gtp.is_gtp_param(p):
                assert torch.equal(p, ref[name]), name
                continue
            # What the GEMM sees in forward and backward: the unsharded weight, bit for bit.
            fwd = p.all_gather_and_prefetch(fwd=True)
            assert fwd.shape == ref[name].shape and torch.equal(fwd, ref[name]), name
            bwd = p.all_gather_and_prefetch_bwd()
            assert torch.equal(bwd, ref[name]), name
            lo, hi = shards.logical_rows(ref[name].shape[0], g, pad, p.group.rank())
            empty_shards += hi == lo
            # wgrad reduce-scatter: rank r contributes (r + 1) * G, so this rank's padded slice
            # of G times g (g + 1) / 2 (sum, calculate_per_token_loss) or (g + 1) / 2 (mean).
            full_grad = torch.randn(ref[name].shape, generator=torch.Generator().manual_seed(7))
            want = torch.nn.functional.pad(full_grad, (0, 0, 0, p.pad_length))
            want = want[p.group.rank() * p.shape[0]:(p.group.rank() + 1) * p.shape[0]]
            for per_token, factor in ((False, (g + 1) / 2), (True, g * (g + 1) / 2)):
                gtp.update_gtp_config(calculate_per_token_loss=per_token)
                p.main_grad.zero_()
                dummy = p.wgrad_reduce_scatter(full_grad * (p.group.rank() + 1))
                assert dummy.shape == p.main_grad.shape
                torch.testing.assert_close(p.main_grad, want * factor, rtol=1e-6, atol=1e-6)
            gtp.update_gtp_config(calculate_per_token_loss=False)
            checked += 1
        ddp.zero_grad_buffer()

        # One forward/backward through the model: every GTP collective goes through the backend.
        counts = {"ag": 0, "rs": 0}
        gtp.gather_along_first_dim = _counting(backend._gather_along_first_dim, counts, "ag")
        gtp.reduce_scatter_along_first_dim = _counting(
            backend._reduce_scatter_along_first_dim, counts, "rs")
        try:
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
            pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
            ddp(tokens, pos, None, labels=tokens).mean().backward()
        finally:
            gtp.gather_along_first_dim = backend._gather_along_first_dim
            gtp.reduce_scatter_along_first_dim = backend._reduce_scatter_along_first_dim
        # Each shard's logical rows got a gradient; its padding rows got exactly zero.
        grads_nonzero, pad_grad_max = True, 0.0
        for p in model.parameters():
            if gtp.is_gtp_param(p):
                lo, hi = shards.logical_rows(p._unsharded_shape[0], g, pad, p.group.rank())
                grads_nonzero &= hi == lo or bool(p.main_grad[:hi - lo].abs().sum() > 0)
                pad_grad_max = max(pad_grad_max, p.main_grad[hi - lo:].abs().max().item()
                                   if hi - lo < p.shape[0] else 0.0)

        # The GTP-aware checkpoint path is on: linear_proj (row-parallel, TP on dim 1) gets a
        # separate GTP axis on dim 0, so its global dim 0 is the padded g * shard, not the shard.
        sd = model.sharded_state_dict()
        proj = next(v for k, v in sd.items() if k.endswith("self_attention.linear_proj.weight"))
        proj_param = model.decoder.layers[0].self_attention.linear_proj.weight
        ckpt_rows = proj.global_shape[-2]

        # check_pad_applied refuses a model built with another alignment.
        mismatch_errors = 0
        for other in (pad * 2, 0):
            try:
                alignment.check_pad_applied(model, other)
            except RuntimeError:
                mismatch_errors += 1
        gtp.update_gtp_config(pad_for_alignment=pad * 2)
        try:
            alignment.check_pad_applied(model, pad * 2)
        except RuntimeError:
            mismatch_errors += 1
        gtp.update_gtp_config(pad_for_alignment=pad)

        n_gtp = sum(gtp.is_gtp_param(p) for p in model.parameters())
        out[(tp, g, pad)] = {
            "checked": checked, "n_gtp": n_gtp, "empty_shards": empty_shards, "counts": counts,
            "grads_nonzero": grads_nonzero, "pad_grad_max": pad_grad_max,
            "mismatch_errors": mismatch_errors,
            "ckpt_rows": ckpt_rows, "proj_padded_rows": proj_param.shape[0] * g,
        }
    return out


def _contribution(kind, group_rank, shape, dtype):
    """The tensor group rank ``group_rank`` passes to a collective in the peer-exchange checks:
    a function of (kind, rank) only, so every rank can build every other rank's input."""
    gen = torch.Generator().manual_seed(1000 * kind + group_rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _peer_exchange_worker():
    """gtp.backend's gloo all-gather and reduce-scatter (point-to-point sends and receives)
    against goldens each rank builds locally from every rank's known input: the gather is the
    concatenation of the shards, the reduce-scatter this rank's rows of the inputs summed in
    group-rank order (plain tensor additions). In order and async; several async collectives
    of different sizes (zero rows included) in flight on one group at once, waited in reverse
    order; fp32 and bf16; groups of 2 (two at once, and ranks 1 and 3) and 4. Outputs are
    pre-filled with a sentinel. Also: a reduce-scatter into rows of its own input, and buffers
    an exchange cannot fill, refused before anything is sent (the next exchange is exact)."""
    from gtp import backend

    rank = torch.distributed.get_rank()
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    odd = torch.distributed.new_group([1, 3])
    groups = {"2": pairs[rank // 2], "4": torch.distributed.new_group([0, 1, 2, 3])}
    if rank in (1, 3):
        groups["1,3"] = odd
    out = {"peer": {}, "ok": [], "refused": [], "aliased": None}

    def golden_rs(kind, me, g, rows, dtype):
        terms = [_contribution(kind, j, (g * rows, 5), dtype)[me * rows:(me + 1) * rows]
                 for j in range(g)]
        want = terms[0]
        for term in terms[1:]:
            want = want + term
        return want

    for name, group in groups.items():
        out["peer"][name] = backend._uses_peer_exchange(group)
        me, g = group.rank(), group.size()
        for dtype in (torch.float32, torch.bfloat16):
            for async_op in (False, True):
                pending = []
                for kind, rows in enumerate((8, 3, 0, 16)):  # four in flight, four sizes
                    shard = _contribution(kind, me, (rows, 5), dtype)
                    gathered = torch.full((g * rows, 5), 7.0, dtype=dtype)
                    _, ag = backend._gather_along_first_dim(shard, group, async_op=async_op,
                                                            output_tensor=gathered)
                    full = _contribution(10 + kind, me, (g * rows, 5), dtype)
                    reduced = torch.full((rows, 5), 7.0, dtype=dtype)
                    _, rs = backend._reduce_scatter_along_first_dim(full, group, async_op,
                                                                    output=reduced)
                    assert (ag is None and rs is None) != async_op, (ag, rs)
                    pending.append((kind, rows, gathered, ag, reduced, rs))
                for kind, rows, gathered, ag, reduced, rs in reversed(pending):
                    for handle in (rs, ag):
                        if handle is not None:
                            handle.wait()
                    want_ag = torch.cat([_contribution(kind, j, (rows, 5), dtype)
                                         for j in range(g)])
                    out["ok"].append(((name, str(dtype), async_op, kind),
                                      torch.equal(gathered, want_ag),
                                      torch.equal(reduced,
                                                  golden_rs(10 + kind, me, g, rows, dtype))))

    group, me = groups["4"], rank
    # The output is this rank's own rows of the input: the sum must read them before writing.
    full = _contribution(20, me, (4 * 6, 5), torch.float32)
    want = golden_rs(20, me, 4, 6, torch.float32)
    _, handle = backend._reduce_scatter_along_first_dim(full, group, False,
                                                        output=full[me * 6:(me + 1) * 6])
    out["aliased"] = torch.equal(full[me * 6:(me + 1) * 6], want)
    # Buffers an exchange cannot fill are refused before anything is posted.
    shard = _contribution(30, me, (4, 5), torch.float32)
    bad_outputs = {"strided": torch.zeros(4 * 4, 10)[:, :5],
                   "rows": torch.zeros(4 * 4 + 1, 5),
                   "dtype": torch.zeros(4 * 4, 5, dtype=torch.float64)}
    for why, bad in bad_outputs.items():
        try:
            backend._gather_along_first_dim(shard, group, output_tensor=bad)
            out["refused"].append((why, "gather", False))
        except ValueError:
            out["refused"].append((why, "gather", True))
    try:
        backend._reduce_scatter_along_first_dim(_contribution(31, me, (16, 5), torch.float32),
                                                group, output=torch.zeros(3, 5))
        out["refused"].append(("rows", "reduce-scatter", False))
    except ValueError:
        out["refused"].append(("rows", "reduce-scatter", True))
    gathered = torch.full((16, 5), 7.0)
    backend._gather_along_first_dim(shard, group, output_tensor=gathered)
    out["after_refusals"] = torch.equal(
        gathered, torch.cat([_contribution(30, j, (4, 5), torch.float32) for j in range(4)]))
    return out


def all_workers():
    """The multi-process checks in one 4-rank world (one interpreter start-up per rank)."""
    return {"backend": _backend_worker(), "invariance": _invariance_worker(),
            "peer_exchange": _peer_exchange_worker()}
