"""What one rank holds at a layout, counted from ``recipes.model.shapes`` without building anything.

Per rank of the most loaded pipeline stage, with megatron's DDP (fp32 gradient buffer,
``grad_reduce_in_fp32``) and Adam, as Megatron-LM's
``theoretical_memory_usage.compute_weight_and_optimizer_memory`` counts them:

* parameters: ``params_dtype`` bytes each (GTP padding rows included: they are allocated);
* gradients: 4 bytes each (fp32 ``main_grad`` buffer);
* optimizer state: ``exp_avg`` and ``exp_avg_sq`` in fp32 (8 bytes), plus an fp32 main copy of
  each parameter (4 bytes) when parameters are bf16; with the distributed optimizer
  (``optim.use_distributed_optimizer``) each data-parallel rank holds 1/dp of it. So bf16:
  18 bytes per parameter without it, 6 + 12 / dp with it.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) as Megatron-LM's ``compute_activation_memory`` applies it, with
or without sequence parallelism; see :func:`activation_bytes`. Temporary
buffers (all-gathers, the loss's logits copies) are not counted.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from recipes.config.errors import ConfigError
from recipes.data import build_tokenizer
from recipes.families import parameter_counts, parameter_shapes
from recipes.families.hybrid.model import (
    ATTENTION,
    GDN,
    MLP,
    MOE,
    is_hybrid,
    layer_symbols,
    mtp_symbols,
)
from recipes.families.hybrid.params import gdn_dims
from recipes.metrics.logger import format_bytes
from recipes.model import te
from recipes.model.mtp import mtp_num_layers
from recipes.model.shapes import local_shape, padded_vocab_size

# Bytes per parameter of each precision.params_dtype.
PARAM_BYTES = {"fp32": 4, "bf16": 2}



@dataclass(frozen=True)
class RankSizes:
    """What one rank of the most loaded pipeline stage holds (bytes unless named otherwise)."""

    total_parameters: int  # the whole model, padded vocabulary, no GTP padding
    parameters: int  # on one rank, GTP padding rows included
    gtp_padding_rows: int  # padding rows added to the TP-local GTP weights (shared by g ranks)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int = 0
    active_parameters: int = 0  # per token: routed experts count topk / num_moe_experts
    expert_parameters: int = 0  # routed-expert parameters on one rank (of ``parameters``)

    @property
    def total_bytes(self) -> int:
        """Parameters, gradients, optimizer state and activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def _stage(name: str, num_layers: int, pp: int) -> tuple[int, ...]:
    """Pipeline stages holding parameter ``name`` (megatron: the embedding on the first stage,
    final norm, MTP layers and output layer on the last, layers split evenly; the last stage
    also holds a copy of the embedding for a shared output weight or for the MTP layers)."""
    if name.startswith("embedding."):
        return (0,)
    if name.startswith("decoder.layers."):
        return (int(name.split(".")[2]) * pp // num_layers,)
    return (pp - 1,)


@dataclass(frozen=True)
class LocalTensor:
    """One parameter as a rank of a pipeline stage holds it (element counts)."""

    name: str
    elements: int  # allocated on the rank, GTP padding rows included
    stored: int  # written to a checkpoint: no GTP padding rows
    expert: bool  # a routed expert's (replicated over the expert data-parallel group)


def _stages(cfg, parallel_dims, padded: int) -> tuple[list[list[LocalTensor]], list[int], int]:
    """``(tensors of each pipeline stage, GTP padding rows of each, whole-model parameters)``;
    an EP rank holds ``num_moe_experts / ep`` experts, each split by etp x expert GTP."""
    tp, g = parallel_dims.tensor_model_parallel_size, parallel_dims.gtp_remat_size
    pad = parallel_dims.pad_for_alignment
    pp, m = parallel_dims.pipeline_model_parallel_size, cfg.model
    per_stage, pad_rows, total = [[] for _ in range(pp)], [0] * pp, 0
    ep, etp, egtp = (parallel_dims.expert_model_parallel_size,
                     parallel_dims.expert_tensor_parallel_size, parallel_dims.expert_gtp_remat_size)
    local_experts = (m.num_moe_experts // ep) if m.get("num_moe_experts") else 0
    copied = m.share_embeddings_and_output_weights or mtp_num_layers(m)
    layers = m.num_layers  # read once: a config read per entry is slow (30,428 in DeepSeek-V3)
    for p in parameter_shapes(m, padded):
        total += math.prod(p.shape)
        if p.expert:
            if int(p.name.split(".local_experts.")[1].split(".")[0]) >= local_experts:
                continue
            shape, pad_length = local_shape(p, etp, egtp, pad)
        else:
            shape, pad_length = local_shape(p, tp, g, pad)
        stages = _stage(p.name, layers, pp)
        if p.name == "embedding.word_embeddings.weight" and copied and pp > 1:
            stages = (0, pp - 1)
        n = math.prod(shape)
        tensor = LocalTensor(p.name, n, n - pad_length * math.prod(shape[1:]), p.expert)
        for s in stages:
            per_stage[s].append(tensor)
            pad_rows[s] += pad_length
    return per_stage, pad_rows, total


def stage_tensors(cfg, parallel_dims, padded: int) -> list[LocalTensor]:
    """The tensors of a rank of the pipeline stage holding the most parameters, at a
    ``padded``-row vocabulary (:func:`rank_sizes`' stage)."""
    per_stage = _stages(cfg, parallel_dims, padded)[0]
    return max(per_stage, key=lambda ts: sum(t.elements for t in ts))


def rank_sizes(cfg, parallel_dims, vocab_size: int) -> RankSizes:
    """Per-rank parameter count and bytes of ``cfg`` at ``parallel_dims`` for a ``vocab_size``-token
    tokenizer (padded as ``recipes.model.shapes.padded_vocab_size``), on the pipeline stage holding the
    most parameters, activations included (:func:`activation_bytes`).

    Optimizer bytes with the distributed optimizer: ``ceil(dense parameters * (8 + main copy) /
    (dp x cp)) + ceil(routed-expert parameters * (8 + main copy) / expert dp)`` (megatron-core's
    ``optimizer.get_megatron_optimizer`` shards the dense state over the data-parallel group
    with context parallelism, the experts' over the expert data-parallel group).
    """
    m = cfg.model
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by,
                               parallel_dims.tensor_model_parallel_size)
    per_stage, pad_rows, total = _stages(cfg, parallel_dims, padded)
    sums = [sum(t.elements for t in ts) for ts in per_stage]
    stage = max(range(len(sums)), key=lambda s: sums[s])
    local = sums[stage]
    experts = sum(t.elements for t in per_stage[stage] if t.expert)
    dtype = cfg.precision.params_dtype
    state = 8 + (4 if dtype != "fp32" else 0)
    dp, edp = ((parallel_dims.data_parallel_size * parallel_dims.context_parallel_size,
                parallel_dims.expert_data_parallel_size)
               if parallel_dims.use_distributed_optimizer else (1, 1))
    return RankSizes(
        active_parameters=parameter_counts(m, padded)[1],
        expert_parameters=experts,
        total_parameters=total, parameters=local, gtp_padding_rows=pad_rows[stage],
        param_bytes=local * PARAM_BYTES[dtype], grad_bytes=local * 4,
        optimizer_bytes=-(-(local - experts) * state // dp) - (-experts * state // edp),
        activation_bytes=activation_bytes(cfg, parallel_dims, padded),
    )


def target_attention(cfg) -> tuple[str, str]:
    """``(kind, source)`` of the attention the estimate assumes: kind ``"fused"``
    (TransformerEngine's fused/flash attention keeps no scores) or ``"local"`` (megatron's
    ``DotProductAttention`` keeps its ``a x s x s`` scores for the backward); source names
    where that came from: ``model.transformer_impl`` (the machine the recipe targets) or, when
    it is null, whether TransformerEngine imports on this machine.

    Raises:
        ValueError: ``model.transformer_impl`` is not null, "transformer_engine" or "local".
    """
    impl = cfg.model.get("transformer_impl")
    if impl is None:
        usable = te.transformer_engine_usable()
        return (("fused" if usable else "local"),
                f"this machine: TransformerEngine {'imports' if usable else 'not importable'}, "
                f"model.transformer_impl=null")
    if impl not in te.TRANSFORMER_IMPLS:
        raise ValueError(f"model.transformer_impl={impl!r}: valid are null, "
                         f"{', '.join(te.TRANSFORMER_IMPLS)}")
    return ("fused" if impl == "transformer_engine" else "local"),\
        f"from model.transformer_impl={impl}"


def attention_scores_stored(cfg) -> bool:
    """Whether attention keeps its ``a x s x s`` scores for the backward (:func:`target_attention`
    is local): megatron's local ``DotProductAttention`` does, fused attention does not."""
    return target_attention(cfg)[0] == "local"


def _attention_terms(m) -> tuple[float, float]:
    """(the attention's tp-split activations, its replicated extra) per ``s b h`` of a layer.

    Standard attention: Q and K ``4 s b h``, V and the projection's input ``2 s b h`` each:
    ``8``, nothing extra. Multi-latent attention (``model.multi_latent_attention``; megatron's
    ``MLASelfAttention``), with ``a`` heads of ``qk_head_dim + qk_pos_emb_head_dim`` query/key
    and ``v_head_dim`` value dims: Q and K ``2 a (qk + pe)`` each, V and the projection's
    input ``2 a v`` each, over ``h``; extra, gathered over tp (split by sequence
    parallelism): the q and kv latents, each stored as its norm's and its up projection's
    input (``4 q_lora_rank + 4 kv_lora_rank``) and the rope key (``2 pe``), over ``h``."""
    if not m.get("multi_latent_attention"):
        return 8.0, 0.0
    a, h = m.num_attention_heads, m.hidden_size
    qk, pe, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    split = (4 * a * (qk + pe) + 4 * a * v) / h
    extra = (4 * (m.get("q_lora_rank") or 0) + 4 * m.kv_lora_rank + 2 * pe) / h
    return split, extra


# Steps of a chunk of the gated delta rule (flash-linear-attention's chunk_gated_delta_rule,
# megatron's torch_chunk_gated_delta_rule: 64).
GDN_CHUNK = 64


def _hybrid_sublayers(m, t: int, sp: int, symbols: str) -> tuple[float, float]:
    """A hybrid stack's activations per ``s b h`` (the layers of ``symbols``; 16-bit units of
    2 bytes, as Korthikanti's constants): ``(the sublayers' sum without attention scores, the
    attention layers' count)`` (the caller adds ``5 a s / h / t`` per attention layer when scores are stored). Each
    sublayer keeps its norm's input, the norm's output and the residual dropout's mask
    (``5``, split by sequence parallelism ``sp``), then:

    * ``*`` attention, the attention half of the GPT layer, Q and the projection's input of
      ``a`` heads and K and V of the query groups, ``d`` = kv_channels wide (``4 (a + groups) d /
      h``: Korthikanti's ``8`` with ``a`` groups of ``h / a``; :func:`_attention_terms` with
      multi-latent attention), with ``attention_output_gate`` the gate's logits and the
      attention output it multiplies (``4 a d / h``, ``d`` = kv_channels), over ``t``;
    * ``-`` MLP, the MLP half, ``4 f / h`` over ``t``;
    * ``E`` MoE, each token's ``moe_router_topk`` dispatched copies, each with its expert's
      input and ``4 F / h`` (``F`` = moe_ffn_hidden_size), and the shared expert's ``4 S / h``
      (experts split by expert TP, not ``t``);
    * ``G`` GatedDeltaNet (megatron's ``GatedDeltaNet.forward`` with flash-linear-attention's
      ``chunk_gated_delta_rule``, which keeps q, k, v, g, beta and the chunk-local ``A`` and
      recomputes the chunk states in the backward): ``in_proj``'s output ``2 P / h``
      (:func:`~recipes.families.hybrid.params.gdn_dims` ``in_proj`` rows), ``conv1d``'s
      SiLU output over q, k, v ``2 C / h``, L2-normalized q and k ``4 qk / h``, the fp32 decay
      ``g`` and bf16 ``beta`` per value head ``6 H / h``, ``A`` (fp32, ``H x 64`` a token)
      ``4 H 64 / h``, the rule's output and the gated ``out_norm``'s (``out_proj``'s input)
      ``4 v / h``, all over ``t``;
    * ``M`` Mamba: the whole transformer layer's formula (not a Mamba layer's)."""
    h, f, a = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    layer_attention, latent = _attention_terms(m)
    attention = layer_attention
    if not m.get("multi_latent_attention"):  # Q and the projection's input of a heads, K and V
        d = m.get("kv_channels") or h // a  # of the groups: 8 for a = groups, d = h / a
        attention = 4 * (a + (m.get("num_query_groups") or a)) * d / h
    if m.get("attention_output_gate"):
        attention += 4 * a * (m.get("kv_channels") or h // a) / h
    total, attention_layers = 0.0, 0
    for symbol in symbols:
        if symbol == ATTENTION:
            total += (5 + latent) / sp + attention / t
            attention_layers += 1
        elif symbol == MLP:
            total += 5 / sp + 4 * f / h / t
        elif symbol == MOE:
            width = m.get("moe_ffn_hidden_size") or f
            shared = m.get("moe_shared_expert_intermediate_size") or 0
            total += 5 / sp + int(m.moe_router_topk) * (2 + 4 * width / h) + 4 * shared / h
        elif symbol == GDN:
            g = gdn_dims(m)
            total += 5 / sp + (2 * g["in_proj"] + 2 * g["conv"] + 4 * g["qk"] + 6 * g["heads"]
                               + 4 * g["heads"] * GDN_CHUNK + 4 * g["v"]) / h / t
        else:  # Mamba
            total += (10 + latent) / sp + (layer_attention + 4 * f / h) / t
            attention_layers += 1
    return total, attention_layers


def activation_bytes(cfg, parallel_dims, padded_vocab: int, scores: bool | None = None) -> int:
    """Activation bytes on a rank of the first pipeline stage (the most in flight).

    Per layer, with ``s`` = seq_length, ``b`` = micro_batch_size, ``h`` = hidden_size, ``a`` =
    heads, ``f`` = ffn_hidden_size, ``t`` = tp (Korthikanti et al. 2022 Table 2, the 24
    generalized to ``8 + 4 f / h`` as Megatron-LM's ``compute_activation_memory``):

    * no recompute: ``s b h (10 + (8 + 4 f / h) / t) + 5 a s^2 b / t`` (the ``8``: attention's
      Q, K, V and projection input, other with multi-latent attention, :func:`_attention_terms`;
      the last term only when
      the attention scores are stored, ``scores``; default :func:`attention_scores_stored`);
      with ``parallelism.sequence_parallel`` (t > 1) the norms' and dropouts' ``10`` is split
      too: ``s b h (10 + 8 + 4 f / h) / t``;
    * ``model.recompute_granularity=selective``: the same without the ``5 a s^2 b / t`` term;
    * ``full``: ``2 s b h`` (each layer's input; ``/ t`` with sequence parallelism).

    A hybrid model (``model.hybrid_layer_pattern``) sums its sublayers' own terms instead
    (:func:`_hybrid_sublayers`; ``full``: ``2 s b h`` each), an MTP layer its MTP part's.

    Times ``num_layers`` (pp stages of num_layers / pp layers, pp micro-batches in flight on the
    first), plus the embedding's ``8 s b pp + s b h pp``; then Megatron-LM's pipeline factors
    (interleaved: ``1 + (pp - 1) / (pp vpp)``; 1F1B: ``min(1, micro-batches / pp)``) and, at
    pp 1, the output layer and loss ``4 s b h + 4 s b v / t`` and, per MTP layer
    (``model.mtp_num_layers``: on the last stage, so only at pp 1 in this first-stage figure), a
    layer plus ``13 s b h + 4 s b v / t`` (embedding dropout, eh_proj's doubled input, three
    norms' and the output layer's inputs, its logits and loss); with sequence parallelism the
    embedding's and output layer's ``s b h`` terms are divided by t. With context parallelism
    each rank holds ``s / cp`` of every sequence: the whole is divided by cp (the ``s^2`` term
    too: each rank's queries against every key). Megatron's constants count 16-bit
    activations; fp32 parameters (fp32 activations) double the figure.
    """
    m, d = cfg.model, cfg.data
    s, b, h, a = m.seq_length, d.micro_batch_size, m.hidden_size, m.num_attention_heads
    f, L = m.ffn_hidden_size, m.num_layers
    t, pp = parallel_dims.tensor_model_parallel_size, parallel_dims.pipeline_model_parallel_size
    vpp = parallel_dims.virtual_pipeline_model_parallel_size
    recompute = m.get("recompute_granularity")
    scores = attention_scores_stored(cfg) if scores is None else scores
    sp = t if parallel_dims.sequence_parallel and t > 1 else 1  # the sequence split over tp ranks
    attention, latent = _attention_terms(m)
    if recompute == "full":
        layer = 2 * s * b * h / sp
    else:
        layer = s * b * h * ((10 + latent) / sp + (attention + 4 * f / h) / t)
        if recompute is None and scores:
            layer += 5 * a * s * s * b / t
    layers = layer * L
    if is_hybrid(m) and recompute != "full":
        def stack(symbols: str) -> float:
            per_sbh, attention_layers = _hybrid_sublayers(m, t, sp, symbols)
            out = s * b * h * per_sbh
            if recompute is None and scores:
                out += attention_layers * 5 * a * s * s * b / t
            return out

        layers = stack(layer_symbols(str(m.hybrid_layer_pattern)))
        layer = stack(mtp_symbols(str(m.hybrid_layer_pattern)))  # an MTP depth's layers
    elif is_hybrid(m):
        layer *= len(mtp_symbols(str(m.hybrid_layer_pattern)))  # each input kept
    act = layers + (8 * s * b * pp + s * b * h * pp) / sp
    if vpp:
        act *= 1 + (pp - 1) / (pp * vpp)
    elif pp > 1:
        data_group = parallel_dims.data_parallel_size * parallel_dims.gtp_remat_size
        micro_batches = d.global_batch_size // (d.micro_batch_size * data_group)
        act *= min(1, micro_batches / pp)
    if pp == 1:
        act += 4 * s * b * h / sp + 4 * s * b * padded_vocab / t
        # MTP layers (on the last stage: here only at pp 1): each a layer, its embedding's
        # dropout (s b h), the inputs of enorm and hnorm (4 s b h), of eh_proj ([embedding;
        # hidden], 4 s b h), of the final norm and the output layer (4 s b h), and its own
        # logits and loss (4 s b v / t).
        act += mtp_num_layers(m) * (layer + 13 * s * b * h / sp + 4 * s * b * padded_vocab / t)
    act /= parallel_dims.context_parallel_size
    if cfg.precision.params_dtype == "fp32":
        act *= 2
    return int(math.ceil(act))


def host_memory_problem(cfg, parallel_dims, vocab_size: int, processes: int,
                        memory_bytes: int) -> str | None:
    """Why ``processes`` ranks of ``cfg`` at ``parallel_dims`` cannot run on a machine of
    ``memory_bytes`` (None: they may): on CPU each rank holds its parameters, gradients,
    optimizer state and activations in host memory (:func:`rank_sizes`, the dry run's
    figures), so a run whose ranks together need more than the machine has cannot run. A
    ``model.seq_length`` taken from a checkpoint (a rotary model stores no tensor it would
    bound) is caught here before any process allocates it."""
    per_rank = rank_sizes(cfg, parallel_dims, vocab_size).total_bytes
    if per_rank * processes <= memory_bytes:
        return None
    return (f"the run needs about {format_bytes(per_rank)} per process for parameters, "
            f"gradients, optimizer state and activations (model.seq_length="
            f"{cfg.model.seq_length}, data.micro_batch_size={cfg.data.micro_batch_size}), "
            f"{processes} processes: more than this machine's {format_bytes(memory_bytes)}; "
            f"train.dry_run=true shows the figures")


def check_host_memory(cfg, parallel_dims) -> None:
    """On CPU (no CUDA device), the ranks this machine starts fit its memory
    (:func:`host_memory_problem`); ``recipes.run.launch`` calls it after ``recipes.config.prelaunch.check``.

    Raises:
        ConfigError: naming the sizes, the fields behind them and the machine's memory.
    """
    import torch

    if torch.cuda.is_available():
        return
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    processes = min(parallel_dims.world_size, cfg.parallelism.nproc_per_node)
    problem = host_memory_problem(cfg, parallel_dims, build_tokenizer(cfg.data).vocab_size,
                                  processes, memory)
    if problem:
        raise ConfigError(problem)
