"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group (``conf/<group>/*.yaml``) is validated against its dataclass at compose time: an
unknown key or a value of the wrong type fails before any process starts. Field names follow
Megatron-LM's arguments (``tensor_model_parallel_size``, ``micro_batch_size``, ``lr_warmup_iters``,
``save_interval``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf

from recipes.checkpoint.auto import default_load
from recipes.config.parallel_dims import default_world_size
from recipes.families import FAMILIES

# The run's resolved config in its output dir: what the workers run (recipes.run.launch writes it).
RESOLVED_CONFIG = "resolved_config.yaml"
# ``parallelism.nproc_per_node``'s default (recipes.config.parallel_dims.default_world_size).
WORLD_RESOLVER = "gtp_recipes_world"


OmegaConf.register_new_resolver(WORLD_RESOLVER, default_world_size, replace=True)

# ``checkpoint.format``'s default: the value of its old name ``gtp.checkpoint_layout`` when that
# was given (an alias that keeps working), else "logical". The old key itself interpolates
# ``${checkpoint.format}``, so both name the format whichever one is typed.
FORMAT_RESOLVER = "gtp_recipes_checkpoint_format"


def _checkpoint_format(*, _root_) -> str:
    node = _root_.gtp._get_node("checkpoint_layout") if "gtp" in _root_ else None
    if node is None or node._is_interpolation():  # the alias was not given
        return "logical"
    return node._value()


OmegaConf.register_new_resolver(FORMAT_RESOLVER, _checkpoint_format, replace=True)


@dataclass
class SharedModelFields:
    """The ``model`` fields every family shares: the GPT decoder's shape. The tiny default has
    dims that are not multiples of 16, so GTP padding matters.

    GPT-2-style blocks by default; the Llama family sets ``normalization: RMSNorm``,
    ``position_embedding_type: rope``, ``swiglu: true``, ``num_query_groups`` (GQA),
    ``add_bias_linear: false`` and untied embeddings (megatron ``TransformerConfig`` fields and
    ``GPTModel`` arguments of the same names).
    """

    name: str = "tiny"
    # The model family (recipes/families/<family>/, docs/model-families.md): gpt | moe | hybrid
    # | llava. Its own fields are its schema.py's, merged into ModelConfig below.
    family: str = "gpt"
    num_layers: int = 2
    hidden_size: int = 72
    num_attention_heads: int = 4
    # Grouped-query attention: K/V heads (null: one per attention head, i.e. multi-head).
    num_query_groups: Optional[int] = None
    ffn_hidden_size: int = 200
    seq_length: int = 64
    # SwiGLU: gated fc1 of 2 * ffn_hidden_size rows (gate then up), as megatron's gated_linear_unit.
    swiglu: bool = False
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    layernorm_epsilon: float = 1.0e-5
    add_bias_linear: bool = True
    # A bias on the QKV projection only (Qwen2/Qwen2.5; megatron's add_qkv_bias).
    add_qkv_bias: bool = False
    # GeLU's tanh approximation (GPT-2's gelu_new; Megatron-LM's --openai-gelu), else exact GeLU.
    openai_gelu: bool = False
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope
    # RoPE (position_embedding_type=rope): base, fraction of head dims rotated, Llama-3.1 scaling.
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    # The vocab is padded to a multiple of lcm(this, tp): the same padded size at every TP that
    # divides it, so the output layer (padded logits included) is identical across layouts.
    make_vocab_size_divisible_by: int = 64
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    share_embeddings_and_output_weights: bool = False
    # Activation recomputation (megatron's recompute_granularity): null stores every activation,
    # "selective" recomputes attention's core (megatron's recompute_modules default), "full"
    # keeps each layer's input only (recompute_method uniform, one layer per group).
    recompute_granularity: Optional[str] = None
    # The layer implementation the recipe is written for: "transformer_engine" (fused attention,
    # no a x s x s scores stored) or "local" (megatron's DotProductAttention stores them). The
    # dry run estimates activations for it; null: whatever this machine has (TransformerEngine
    # if it imports). A run builds TransformerEngine layers where it imports unless "local"
    # (recipes.model.te.uses_transformer_engine); without it, local layers.
    transformer_impl: Optional[str] = None
    # Attention head width (megatron's kv_channels); null: hidden_size / num_attention_heads.
    kv_channels: Optional[int] = None
    # RMSNorm/LayerNorm over each query and key head before attention (Qwen3, OLMo-2).
    qk_layernorm: bool = False
    # Gated attention (Qwen3-Next's full-attention layers; megatron's attention_output_gate):
    # the QKV projection also computes a gate per query head, and attention's output is
    # multiplied by sigmoid(gate) before the output projection: heads * kv_channels more rows
    # (docs/gated-attention.md).
    attention_output_gate: bool = False
    # Multi-token prediction (megatron's names; DeepSeek-V3's MTP, docs/mtp.md): null or 0: none;
    # N: N MTP layers after the decoder, on the last pipeline stage, each predicting one more
    # token ahead; their mean loss times mtp_loss_scaling_factor is added to the lm loss.
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1


# The shared fields that size a parameter (recipes.families.parameter_shapes reads them); each
# family declares its own (ModelFamily.shape_fields).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "swiglu", "normalization", "add_bias_linear", "add_qkv_bias",
                "position_embedding_type", "seq_length", "share_embeddings_and_output_weights",
                "kv_channels", "qk_layernorm", "mtp_num_layers", "attention_output_gate")


# Bases in reverse: a dataclass orders fields from its last base, so the shared fields come first.
@dataclass
class ModelConfig(*reversed([f.fields for f in FAMILIES if f.fields is not None]),
                  SharedModelFields):
    """The ``model`` group: the shared fields and every family's own (its ``schema.py``);
    ``family`` chooses which family builds the model, and the fields of the others must stay
    unset (``recipes.families.check_family_fields``)."""


@dataclass
class ParallelismConfig:
    """Process layout. World size = tp * pp * cp * gtp_remat_size * dp (dp derived when null).

    ``nproc_per_node`` defaults to tp * pp * cp * gtp_remat_size * dp (dp 1 when null), so a layout
    override alone runs; a value given explicitly wins and is checked against the degrees.
    """

    name: str = "dp2"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Model chunks per pipeline stage (megatron's interleaved 1F1B schedule); null: one chunk.
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # null: derived as world_size / (tp * pp * cp * gtp_remat_size).
    data_parallel_size: Optional[int] = None
    # Megatron's sequence parallelism: norms, dropout and the MoE dispatch see 1/tp of the
    # sequence (required by megatron for MoE with tp > 1; recipes.config.validate says so).
    sequence_parallel: bool = False
    # MoE layouts (megatron names): experts split over expert_model_parallel_size ranks, each
    # expert's linears over expert_tensor_parallel_size ranks (null: tensor_model_parallel_size);
    # the expert data-parallel size is derived: world / (etp x ep x pp x gtp.expert_gtp_remat_size).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    # Context parallelism: each sequence split over this many ranks (recipes.model.context_parallel);
    # needs TransformerEngine's attention (refused before launch without it).
    context_parallel_size: int = 1
    # Processes started on this machine by train.py (ignored when RANK/WORLD_SIZE are set).
    nproc_per_node: int = II(
        f"{WORLD_RESOLVER}:${{.tensor_model_parallel_size}},${{.pipeline_model_parallel_size}},"
        "${gtp.gtp_remat_size},${.data_parallel_size},${.expert_model_parallel_size},"
        "${.expert_tensor_parallel_size},${gtp.expert_gtp_remat_size},${.context_parallel_size}")


@dataclass
class GTPConfig:
    """Generalized Tensor Parallelism (weight remat over the ``gtp_remat`` group)."""

    name: str = "off"
    gtp_remat_size: int = 1
    # Expert GTP (megatron's expert_gtp_remat_size / expert_gtp_weight_remat_size): routed
    # expert weights sharded over their own remat group; same pad_for_alignment as gtp_remat_size.
    expert_gtp_remat_size: int = 1
    # null: the quantization recipe's default (none -> 1, fp8 -> 16, mxfp8 -> 32, nvfp4 -> 16).
    pad_for_alignment: Optional[int] = None
    quantization: str = "none"  # none | fp8 | mxfp8 | nvfp4
    # Keep weights in FP8 and all-gather them in FP8 (megatron's fp8_param + DDP
    # fp8_param_gather; Megatron-LM's --fp8-param-gather): GTP's weight all-gather moves FP8
    # bytes. quantization fp8 or mxfp8 with the distributed optimizer; needs TransformerEngine.
    fp8_param_gather: bool = False
    # megatron's GTP overlap (GTP_CONFIG fields): all-gather the next weight while this layer
    # computes, and reduce-scatter weight gradients while the backward goes on. null: megatron's
    # default (on) with TransformerEngine; on the gloo backend async_reduction on outside
    # pipeline parallelism and weight_prefetch off (recipes.model.gtp_setup.overlap_settings).
    weight_prefetch: Optional[bool] = None
    async_reduction: Optional[bool] = None
    # The old name of checkpoint.format (an alias: either may be typed; both hold the value).
    checkpoint_layout: str = "${checkpoint.format}"


@dataclass
class PrecisionConfig:
    """Parameter dtype. fp32 on CPU by default."""

    name: str = "fp32"
    params_dtype: str = "fp32"  # fp32 | bf16


@dataclass
class DataConfig:
    """Training text.

    ``source``: ``pydoc`` (CPython's bundled documentation text, tokenized on first use and
    cached), ``indexed`` (existing Megatron .bin/.idx prefixes in ``paths``, tokenized with
    ``tokenizer``), ``text`` (.txt / .jsonl files in ``paths``, converted on first use), ``mock``
    (megatron's MockGPTDataset, no files), ``shapes`` (images of coloured shapes with their
    captions, drawn here: a vision-language model's data, ``recipes.data.images``), ``chat``
    (.jsonl conversations in ``paths`` rendered with the tokenizer's chat template, the loss on
    the assistant turns, ``recipes.data.chat``).
    """

    name: str = "pydoc"
    source: str = "pydoc"
    paths: list[str] = field(default_factory=list)
    # byte: 256 byte values + <eod>; for ``indexed`` data made with another tokenizer set
    # ``vocab_size`` (and ``eod_id``) to that tokenizer's.
    tokenizer: str = "byte"
    vocab_size: Optional[int] = None
    eod_id: Optional[int] = None
    jsonl_key: str = "text"
    # source=chat (recipes.data.chat): a .jinja chat template replacing the tokenizer's; a
    # conversation longer than model.seq_length is cut (truncate) or left out (drop); pack
    # conversations into each sample (each attending only within itself); validation files
    # (empty: data.split's validation share of the conversations); the split read from a
    # DatasetDict saved with the datasets library (for data.paths, for data.valid_paths).
    chat_template: Optional[str] = None
    chat_overlong: str = "truncate"
    chat_packing: bool = False
    valid_paths: list[str] = field(default_factory=list)
    chat_split: str = "train"
    chat_valid_split: str = "validation"
    split: str = "98,2,0"
    cache_dir: str = "${oc.env:GTP_RECIPES_CACHE,${hydra:runtime.cwd}/.cache}"
    micro_batch_size: int = 4
    global_batch_size: int = 16


@dataclass
class OptimConfig:
    """Adam (or Muon) with linear warmup then cosine decay (megatron's OptimizerParamScheduler)."""

    name: str = "adam"
    optimizer: str = "adam"
    lr: float = 3.0e-3
    min_lr: float = 3.0e-4
    lr_warmup_iters: int = 10
    lr_decay_style: str = "cosine"
    # null: decay over train.train_iters.
    lr_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0
    # megatron's DistributedOptimizer (ZeRO-1): Adam state and fp32 main params sharded over DP.
    use_distributed_optimizer: bool = False
    # How its state is sharded in a checkpoint (megatron's metadata["distrib_optim_sharding_type"]);
    # only the two that survive a layout change are accepted: fully_sharded_model_space (each DP
    # rank writes and reads its own range) and fully_reshardable (gathered to every DP rank).
    distrib_optim_sharding_type: str = "fully_sharded_model_space"
    # On resume, take lr/min_lr/warmup/decay/weight decay from this config instead of the
    # checkpoint's (Megatron-LM's --override-opt_param-scheduler).
    override_opt_param_scheduler: bool = False
    # optimizer=muon (conf/optim/muon.yaml, docs/muon.md): megatron's OptimizerConfig names.
    # Muon for 2-D weights, Adam (the adam_* fields) for embeddings, output layer, norms, biases.
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    # "highest": full fp32 Newton-Schulz matmuls, the same update at every layout.
    muon_fp32_matmul_prec: str = "highest"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    # "duplicated": each TP rank orthogonalizes the whole matrix (same math at any TP);
    # "blockwise" (megatron's default) orthogonalizes each TP shard on its own.
    muon_tp_mode: str = "duplicated"
    muon_extra_scale_factor: float = 1.0


@dataclass
class CheckpointConfig:
    """Megatron's directory structure: ``<save>/iter_0000010/`` (torch_dist) +
    ``latest_checkpointed_iteration.txt``."""

    name: str = "default"
    save: Optional[str] = "${output_dir}/checkpoints"
    save_interval: int = 50
    # A checkpoint dir written by a previous run (any layout); null starts from scratch; auto
    # loads the newest complete save of `save` if there is one, else starts from scratch
    # (recipes/checkpoint/auto.py; the default under hydra/launcher=slurm and submitit_local).
    load: Optional[str] = None
    # Start from these weights only (a Hugging Face model dir or a checkpoint; any layout): fresh
    # optimizer, schedule and iteration, model fields from the source (recipes/run/pretrained.py).
    pretrained: Optional[str] = None
    # Load this iteration instead of the tracker's latest (Megatron-LM's --ckpt-step).
    load_iteration: Optional[int] = None
    # Remove older iter_* dirs once a newer save is complete; null keeps all.
    keep_last: Optional[int] = None
    # Save at the last iteration even when it is not a multiple of save_interval.
    save_at_end: bool = True
    # Write checkpoints in the background (megatron's async torch_dist save): training goes on
    # while the files are written; the tracker names a save once every rank's write is done.
    async_save: bool = False
    # Save into a dir that holds another run's checkpoints (refused by default): a save of an
    # existing iteration replaces it once complete, the tracker names this run's newest save.
    allow_existing_save: bool = False
    # Resume although seed, data, seq length or a batch size not dividing the consumed samples
    # changed (refused by default: the run would see other samples than planned).
    allow_data_change: bool = False
    # How GTP weights are written on disk: "logical" (gtp/'s fix: padding never reaches disk,
    # loads at any parallel layout) or "stock" (megatron-core 0.19.2's padded format; for
    # comparisons and tests). Old name: gtp.checkpoint_layout (docs/checkpoint-format.md).
    format: str = f"${{{FORMAT_RESOLVER}:}}"
    # Before a resume, check every byte of the checkpoint (python -m gtp verify, each rank a
    # share of the data files) and refuse a damaged one before any weight is overwritten.
    verify_on_load: bool = True


@dataclass
class LoggerConfig:
    """Metric sinks. The local JSONL file is always written; wandb is added by ``logger=wandb``."""

    name: str = "wandb"
    wandb: bool = True
    project: str = "gtp-recipes"
    entity: Optional[str] = None
    # offline unless set to online (needs WANDB_API_KEY) .
    mode: str = "offline"
    run_name: Optional[str] = None
    # Also log the grad norm per layer type (grad-norm/embedding, /attention, /mlp, /norms,
    # /output) and per transformer layer (grad-norm/layer-<i>), each logical element once.
    grad_norm_detail: bool = False
    # The iteration line: compact (fits 160 columns) or full (every figure Megatron-LM prints);
    # metrics.jsonl and wandb hold every figure either way.
    console_line: str = "compact"


@dataclass
class TrainConfig:
    """Loop length and bookkeeping."""

    train_iters: int = 200
    seed: int = 1234
    log_interval: int = 1
    # Validation loss ("lm loss validation") every eval_interval iterations (0: only at the
    # end) and at the end of training, over eval_iters global batches of data.split's
    # validation share (0: no validation).
    eval_interval: int = 50
    eval_iters: int = 2
    # Stop before an optimizer step whose lm loss or grad-norm is NaN/inf (Megatron-LM's
    # --check-for-nan-in-loss-and-grad); nothing non-finite reaches the weights or a checkpoint.
    check_for_nan_in_loss_and_grad: bool = True
    # With the check on: skip such a step instead of stopping, counted in `skipped-iterations`.
    skip_nonfinite_iterations: bool = False
    # The loss and its gradients as the mean over the global batch's loss tokens (Megatron-LM's
    # --calculate-per-token-loss), not the mean of each micro-batch's mean: independent of
    # data.micro_batch_size and the data-parallel size where loss masks differ (LLaVA captions).
    calculate_per_token_loss: bool = False
    # Validate the config for its world size and print the layout and per-rank sizes
    # (recipes/dry_run/); builds nothing heavy and starts no process.
    dry_run: bool = False
    # Exit with a save (recipes/run/preemption.py, Megatron-LM's --exit-signal-handler): on SIGTERM
    # and this signal (e.g. SIGUSR2, submitit's), every rank saves at the next iteration
    # boundary and the run exits 0.
    exit_signal: str = "SIGTERM"
    # Save and exit 0 after this many minutes of training (Megatron-LM's --exit-duration-in-mins).
    exit_duration_in_mins: Optional[float] = None
    # Save and exit 0 at the first iteration that is a multiple of this (--exit-interval).
    exit_interval: Optional[int] = None
    # Memory of one accelerator, GiB: the dry run says whether a rank's estimate fits in it.
    gpu_memory_gib: float = 80.0
    # Accelerators (ranks) per node of the target cluster: the dry run's per-node host memory
    # of a save and a load (recipes/dry_run/host.py).
    gpus_per_node: int = 8


@dataclass
class Config:
    """The whole run. ``conf/config.yaml``'s defaults list fills the groups."""

    model: ModelConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    gtp: GTPConfig = MISSING
    precision: PrecisionConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    logger: LoggerConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    # Where this job writes (Hydra's output dir); filled in at compose time.
    output_dir: str = "${hydra:runtime.output_dir}"


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "gtp": GTPConfig,
    "precision": PrecisionConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """Register ``Config`` and each group's schema (``<group>_schema``) in Hydra's ConfigStore.

    Group yaml files name ``/<group>_schema@_here_`` first in their defaults list so they are
    typed; the schemas are top-level configs, not group options, so ``model=...`` never offers
    or accepts them.
    """
    from omegaconf import OmegaConf

    # checkpoint.load's default: auto under a submitit launcher (conf/checkpoint/default.yaml).
    OmegaConf.register_new_resolver("recipes_default_load", default_load, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, node in GROUPS.items():
        cs.store(name=f"{group}_schema", node=node)


def to_dict(cfg: Any) -> dict:
    """A resolved plain-dict copy of an OmegaConf config (for checkpoints and logs)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def given_overrides() -> list[str]:
    """The command line's overrides (Hydra's ``overrides.task``), [] outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ValueError, ImportError):
        return []


def given_fields(overrides: list[str], group: str) -> tuple[set, bool]:
    """(fields of ``group`` given as ``group.field=...``, whether the group itself was chosen
    as ``group=NAME``)."""
    fields, chosen = set(), False
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key == group:
            chosen = True
        elif key.startswith(group + "."):
            fields.add(key[len(group) + 1:])
    return fields, chosen
