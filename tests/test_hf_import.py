"""``python -m gtp import`` and ``checkpoint.pretrained``: Hugging Face models built and saved by
``transformers`` (the goldens: nothing of gtp/ or recipes/ makes them) round-trip bit for bit,
load at several layouts with transformers' logits, and fine-tune from iteration 0.

Models: a tiny Llama (GQA 4 heads / 2 groups, untied output, Llama-3 RoPE scaling with a large
rope_theta so that many frequencies are scaled) and a tiny GPT-2 (exact GeLU, biases, untied,
saved in shards with an index); a tied GPT-2 for the round trip only (tied models at GTP layouts:
tests/test_tied_embeddings_e2e.py). Norm weights and biases are drawn away from their initial 1/0 so that a misplaced
tensor shows.

The Llama architectures of other names and GPT-2's published activation, 4 layers each, with
dims that GTP alignment pads at tp2 x gtp2/a16 (QKV rows 120, 160 with Qwen3's head_dim 16, or
216; SwiGLU fc1 200): a Mistral (no sliding window), a Qwen2 (q/k/v biases), a Qwen3 (q/k
norms, head_dim 16 apart from hidden / heads) and a GPT-2 with ``gelu_new``. A Mistral comes
back as the LlamaForCausalLM that computes it.

One 4-process world loads the Llama and GPT-2 imports at tp1 (dp4), tp2 x gtp2 with
pad_for_alignment 16 (dp1) and pp2 (dp2), and the other four at tp2 x gtp2/a16, and takes one training step at tp2 x gtp2 whose ``lm loss`` is compared with
transformers' loss on the same micro-batches. Tolerances (fp32): logits 1e-4 absolute (the
issue's bound), the loss 1e-5 relative (reduction order only).
"""

from __future__ import annotations

import glob
import io
import json

import pytest
import torch
from omegaconf import OmegaConf

from compose import make_cfg
from hf_checks import assert_import_refused, byte_bpe, megatron_logits, pretrained_run
from ckpt import cli
from multiproc import run_distributed
from tolerance import LLAMA_TINY, assert_fp32_close

pytestmark = pytest.mark.multiprocess

WORLD = 4
VOCAB = 257  # the byte tokenizer's, so the recipes' data pipeline feeds these models
SEQ = 64
LOGITS_ATOL = 1e-4
# name: overrides
# Llama architectures of other names and GPT-2's published activation (loaded at the GTP layout).
NEW = ("mistral", "qwen2", "qwen3", "gpt2_new")
LAYOUTS = {
    "tp1": [],
    "tp2_gtp2_a16": ["parallelism.tensor_model_parallel_size=2", "gtp.gtp_remat_size=2",
                     "gtp.pad_for_alignment=16"],
    "pp2": ["parallelism.pipeline_model_parallel_size=2"],
}


def _save_models(root):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=256, eos_token_id=256))
    gpt2, gpt2_tied = (GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eod, eos_token_id=eod, tie_word_embeddings=tied))
        for tied, eod in ((False, 256), (True, 0)))
    with torch.no_grad():
        for model in (llama, gpt2, gpt2_tied):
            for name, p in model.named_parameters():
                if "norm" in name or ".ln" in name:
                    p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.1)
                elif name.endswith("bias"):
                    p.normal_(0, 0.1)
    _save_new_models(root)
    llama.save_pretrained(root / "llama")
    llama.to(torch.bfloat16).save_pretrained(root / "llama_bf16")  # for the bf16 fine-tune
    gpt2.save_pretrained(root / "gpt2", max_shard_size="100KB")  # sharded, with an index
    gpt2_tied.save_pretrained(root / "gpt2_tied")
    byte_bpe(VOCAB).save(str(root / "gpt2_tied" / "tokenizer.json"))  # its end of text is id 0


def _save_new_models(root):
    from transformers import (GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(1)
    dims = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=100, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=SEQ,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                bos_token_id=256, eos_token_id=256)
    models = {
        "mistral": MistralForCausalLM(MistralConfig(**dims, sliding_window=None)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**dims)),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(**dims, head_dim=16)),
        "gpt2_new": GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=72, n_layer=4, n_head=4,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=256, eos_token_id=256, tie_word_embeddings=False)),
    }
    with torch.no_grad():
        for name, model in models.items():
            for n, p in model.named_parameters():
                if "norm" in n or ".ln" in n or n.endswith("bias"):
                    p.normal_(0.5, 0.1)  # away from 1 / 0: a misplaced tensor shows
                elif name == "gpt2_new" and ("mlp." in n or "lm_head" in n):
                    # Large enough that the erf GeLU's logits leave gelu_new's by ~3e-3, far
                    # above LOGITS_ATOL: the test tells the two activations apart.
                    p.normal_(0, 0.3)
            model.save_pretrained(root / name)


def _tensors(d) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{d}/*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    _save_models(root)
    for name in ("llama", "gpt2", "gpt2_tied", *NEW):
        printed = io.StringIO()
        assert cli.main(["import", str(root / name), str(root / f"{name}_ckpt")], out=printed) == 0
        assert f"checkpoint.pretrained={root / name}_ckpt" in printed.getvalue()
    return root


def _config_facts(config) -> dict:
    """What makes two transformers configs compute the same model."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(config, trust_remote_code=False)
    d = c.to_dict()
    if c.model_type == "gpt2":
        d["n_inner"] = d["n_inner"] or 4 * d["n_embd"]
    drop = ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")
    return {k: v for k, v in d.items() if k not in drop}


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt2_tied", *NEW])
def test_import_then_export_is_bit_equal(hf, tmp_path, name):
    out = tmp_path / "exported"
    assert cli.main(["export", str(hf / f"{name}_ckpt"), str(out)]) == 0
    src, back = _tensors(hf / name), _tensors(out)
    assert sorted(src) == sorted(back)
    for key, tensor in src.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    if name == "mistral":  # the LlamaForCausalLM that computes it: the same logits
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want, got = (_hf_model(d.parent, d.name)(tokens).logits for d in (hf / name, out))
        assert _config_facts(out)["model_type"] == "llama" and torch.equal(got, want)
        return
    assert _config_facts(out) == _config_facts(hf / name)
    if name == "gpt2_tied":  # the source's tokenizer.json came along, loadable by AutoTokenizer
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
        assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
        assert tok.decode(tok("hello wide world").input_ids) == "hello wide world"


def test_refusals_name_the_field_or_tensor(hf, tmp_path):
    import shutil

    from ckpt.hf import hf_import

    def refused(src: str, change: dict, match: str, out: str) -> None:
        assert_import_refused(hf, src, change, match, tmp_path, out)

    refused("gpt2", {"activation_function": "relu"}, "activation_function='relu'", "out1")
    # Settings megatron-core 0.19.2 has no field for, named before anything is written.
    refused("mistral", {"sliding_window": 32}, r"sliding_window=32: .*at least "
            r"max_position_embeddings=64", "out5")
    refused("qwen2", {"use_sliding_window": True}, "use_sliding_window=True", "out6")
    refused("qwen3", {"attention_bias": True}, "attention_bias=True", "out7")
    bad = tmp_path / "scaled"
    shutil.copytree(hf / "llama", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"]["high_freq_factor"] = 2.0
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf_import.HFImportError, match="rope_parameters.high_freq_factor"):
        hf_import.import_hf(bad, tmp_path / "out2")
    # A tensor with no megatron counterpart.
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "extra"
    shutil.copytree(hf / "llama", bad)
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf_import.HFImportError, match="q_norm.weight"):
        hf_import.import_hf(bad, tmp_path / "out3")
    assert not (tmp_path / "out3" / "iter_0000000").exists()


def _import_in_a_subprocess(src, out, timeout: float = 90) -> tuple[int, str]:
    """``gtp import SRC OUT`` in a fresh interpreter, killed after ``timeout`` seconds (an import
    that grows without bound fails the test instead of filling the machine)."""
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-m", "gtp", "import", str(src), str(out)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"still running after {timeout} s"
    return proc.returncode, proc.stdout + proc.stderr


def test_sizes_and_paths_are_checked_before_anything_is_read(hf, tmp_path):
    """Every size of config.json against the tensors' shapes, before anything is planned (a
    billion layers is refused at once); every file the import reads inside the given dir."""
    import os
    import shutil

    from ckpt.hf import hf_import

    bad = tmp_path / "billion"
    shutil.copytree(hf / "llama", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1_000_000_000}))
    rc, out = _import_in_a_subprocess(bad, tmp_path / "out1")
    assert rc == 2, out
    assert ("config.json num_hidden_layers=1000000000: the weights hold layers 0 to 1 "
            "(2 layers)") in out, out
    bad = tmp_path / "wider"
    shutil.copytree(hf / "llama", bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(hf_import.HFImportError,
                       match=r"config.json intermediate_size=128: tensor "
                             r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\)"):
        hf_import.import_hf(bad, tmp_path / "out2")
    # An index entry outside the dir (a valid shard there: read, before, and imported).
    bad = tmp_path / "model" / "gpt2"
    shutil.copytree(hf / "gpt2", bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.move(bad / shard, tmp_path / "model" / "x.safetensors")
    index["weight_map"] = {k: ("../x.safetensors" if f == shard else f)
                           for k, f in index["weight_map"].items()}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf_import.HFImportError,
                       match=r"model.safetensors.index.json weight_map\['.*'\] = "
                             r"'../x.safetensors' resolves to .*, outside the model directory"):
        hf_import.import_hf(bad, tmp_path / "out3")
    # A weight file that is a link to a file elsewhere.
    bad = tmp_path / "linked"
    shutil.copytree(hf / "llama", bad)
    shutil.move(bad / "model.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", bad / "model.safetensors")
    with pytest.raises(hf_import.HFImportError,
                       match=r"the weight file = 'model.safetensors' resolves to .*"
                             r"elsewhere.safetensors, outside the model directory"):
        hf_import.import_hf(bad, tmp_path / "out4")
    for n in range(1, 5):
        assert not (tmp_path / f"out{n}" / "iter_0000000").exists()


def _cfg(hf_root: str, name: str, layout: list, out: str, cache: str) -> str:
    from recipes.run import pretrained

    cfg = make_cfg(f"checkpoint.pretrained={hf_root}/{name}", f"parallelism.nproc_per_node={WORLD}",
                   "logger=none", "train.eval_iters=0", "optim.lr_warmup_iters=0", *layout)
    cfg.output_dir, cfg.data.cache_dir = out, cache
    pretrained.apply_source(cfg, overrides=[])
    pretrained.prepare(cfg, True)
    return OmegaConf.to_yaml(cfg)


class _Recording:
    """A data iterator that keeps what it yields."""

    def __init__(self, it):
        self.it, self.seen = it, []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return batch


def _world(cfgs: dict) -> dict:
    from megatron.core import parallel_state

    from multiproc import reset_model_parallel
    from recipes.data import build_iterators
    from recipes.run.loop import train_step

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    out = {}
    for key, cfg_yaml in cfgs.items():
        cfg, tokenizer, model, optimizer, scheduler = pretrained_run(cfg_yaml)
        result = {"logits": megatron_logits(model, tokens), "tokens": tokens}
        if key in ("llama_tp2_gtp2_a16", "gpt2_tp2_gtp2_a16"):
            model.train()
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            dp_rank = torch.distributed.get_rank(group)
            dp_size = torch.distributed.get_world_size(group)
            train_iter, _ = build_iterators(cfg, 0, dp_rank, dp_size, tokenizer)
            train_iter = _Recording(train_iter)
            n = cfg.data.global_batch_size // (cfg.data.micro_batch_size * dp_size)
            result["step"] = train_step(model, optimizer, scheduler, train_iter, n, cfg)
            result["batches"] = {dp_rank: train_iter.seen}
        out[key] = result
    reset_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(hf, tmp_path_factory, data_cache):
    cfgs = {}
    for name, lay in [(n, lay) for n in ("llama", "gpt2") for lay in LAYOUTS] + [
            (n, "tp2_gtp2_a16") for n in NEW]:
        out = tmp_path_factory.mktemp(f"{name}_{lay}")
        cfgs[f"{name}_{lay}"] = _cfg(str(hf), name, LAYOUTS[lay], str(out), str(data_cache))
    results = run_distributed(_world, WORLD, cfgs, timeout=900)
    merged = {}
    for key in cfgs:
        ranks = [r[key] for r in results]
        with_logits = [r for r in ranks if r["logits"] is not None]
        merged[key] = {**ranks[0], "logits": with_logits[0]["logits"]}
        if "batches" in ranks[0]:  # the global batch: each data-parallel rank's micro-batches
            by_dp = {}
            for r in ranks:
                by_dp.update(r["batches"])
            merged[key]["batches"] = [b for dp in sorted(by_dp) for b in by_dp[dp]]
    return merged


def _hf_model(hf, name):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf / name, trust_remote_code=False).eval()


@pytest.mark.parametrize("name, lay", [(n, lay) for n in ("llama", "gpt2") for lay in LAYOUTS]
                         + [(n, "tp2_gtp2_a16") for n in NEW])
def test_logits_equal_transformers(hf, world, name, lay):
    res = world[f"{name}_{lay}"]
    with torch.no_grad():
        expected = _hf_model(hf, name)(res["tokens"]).logits
    got = res["logits"]
    assert got.shape[:2] == expected.shape[:2] and got.shape[-1] >= VOCAB
    diff = (got[..., :VOCAB] - expected).abs().max().item()
    assert diff <= LOGITS_ATOL, (name, lay, diff)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_first_loss_equals_transformers_loss(hf, world, name):
    """The ``lm loss`` of iteration 1 from the pretrained weights is transformers' loss on the
    same micro-batches (mean of each micro-batch's masked token mean)."""
    import torch.nn.functional as F

    res = world[f"{name}_tp2_gtp2_a16"]
    model = _hf_model(hf, name)
    losses = []
    with torch.no_grad():
        for b in res["batches"]:
            logits = model(b["tokens"], position_ids=b["position_ids"]).logits
            ce = F.cross_entropy(logits.reshape(-1, VOCAB), b["labels"].reshape(-1),
                                 reduction="none")
            mask = b["loss_mask"].reshape(-1).float()
            losses.append((ce * mask).sum() / mask.sum())
    expected = torch.stack(losses).mean().item()
    assert len(res["batches"]) == 4
    # megatron's forward against transformers': one step's rounding (LLAMA_TINY: the larger model)
    assert_fp32_close(res["step"]["lm loss"], expected, 1, LLAMA_TINY, what=(name,))


def test_pretrained_fine_tune_with_zero_lr_exports_the_source(hf, tmp_path, train_jobs):
    """``checkpoint.pretrained=HF_DIR`` at tp2 x gtp2 (pad 16) in bf16 with the distributed
    optimizer, lr 0, one iteration, on 4 ranks (in one world, as torchrun's workers run it:
    tests/helpers/inworld.py; nothing here is the launcher's): the saved checkpoint exports to
    the source's tensors bit for bit (the fp32 main params were refreshed from the loaded
    weights, not left at the random init); the run starts at iteration 0 with the source's
    model fields, and the export of this byte-tokenizer run has eos_token_id 256."""
    from recipes.metrics.logger import read_metrics

    out = tmp_path / "job"
    job, = train_jobs([(out, [
        f"checkpoint.pretrained={hf / 'llama_bf16'}", "parallelism=tp2",
        "parallelism.nproc_per_node=4", "gtp.gtp_remat_size=2", "gtp.pad_for_alignment=16",
        "precision=bf16", "optim.use_distributed_optimizer=true", "optim.lr=0", "optim.min_lr=0",
        "train.train_iters=1", "optim.lr_warmup_iters=0", "train.eval_iters=0",
        "checkpoint.save=" + str(out / "ckpt")])])
    assert "imported" in job.stdout
    resolved = OmegaConf.load(out / "resolved_config.yaml")
    assert resolved.model.num_query_groups == 2 and resolved.model.rope_scaling is True
    rows, events = read_metrics(out)
    assert [r["iteration"] for r in rows if "lm loss" in r] == [1]
    assert events[0]["event"] == "start" and events[0]["pretrained"] == str(hf / "llama_bf16")
    assert resolved.checkpoint.pretrained == str(hf / "llama_bf16")  # in wandb's run config
    exported = tmp_path / "exported"
    assert cli.main(["export", str(out / "ckpt"), str(exported)]) == 0
    src, back = _tensors(hf / "llama_bf16"), _tensors(exported)
    assert sorted(src) == sorted(back)
    for key, tensor in src.items():
        assert back[key].dtype == tensor.dtype == torch.bfloat16, key
        assert torch.equal(back[key], tensor), key
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == 256


def test_a_fine_tune_at_the_default_lr_is_told_so_in_one_line():
    """``checkpoint.pretrained`` with ``optim.lr`` set neither on the command line nor by an
    experiment: one line naming the lr in use and how to set it (issue 58 item 6: a fine-tune
    silently took the tiny preset's 3e-3); none when set, or without pretrained."""
    from recipes.run.pretrained import lr_note

    src = "checkpoint.pretrained=/hf/qwen3"
    assert lr_note(make_cfg(src), overrides=[src]) == (
        "> note: this fine-tune of checkpoint.pretrained=/hf/qwen3 uses the default "
        "optim.lr=0.003 (min_lr 0.0003), set for training a tiny model from scratch; a "
        "fine-tune usually wants far less, e.g. optim.lr=1e-5 optim.min_lr=1e-6")
    assert lr_note(make_cfg(src, "optim.lr=1e-5"), overrides=[src, "optim.lr=1e-5"]) is None
    assert lr_note(make_cfg(src, "optim.lr=3e-3"), overrides=[src, "optim.lr=3e-3"]) is None
    experiment = ["experiment=llama3_8b_tp4_gtp2_fp8", src]  # its optim.lr=3e-4
    assert lr_note(make_cfg(*experiment), overrides=experiment) is None
    assert lr_note(make_cfg(), overrides=[]) is None


def test_pretrained_model_fields_and_refusals_before_launch(hf):
    """Fields come from the source unless given; a given field that contradicts the source's
    tensors, both load and pretrained, or another vocabulary are refused, each named."""
    from recipes.run import pretrained
    from recipes.data.tokenizers import check_before_launch
    from recipes.config.validate import ConfigError

    src = f"checkpoint.pretrained={hf / 'llama'}"
    cfg = make_cfg(src, "model.rotary_base=10000")
    pretrained.apply_source(cfg, overrides=["model.rotary_base=10000"])
    assert (cfg.model.hidden_size, cfg.model.num_query_groups, cfg.model.normalization) == (
        64, 2, "RMSNorm")
    assert cfg.model.rotary_base == 10000 and cfg.model.rope_scaling is True  # given: kept
    cfg = make_cfg(src, "model.hidden_size=96")
    with pytest.raises(ConfigError, match=r"model.hidden_size=96 \(the source has 64\)"):
        pretrained.apply_source(cfg, overrides=["model.hidden_size=96"])
    # A Hugging Face model has no MTP layers, and none are added to it.
    cfg = make_cfg(src, "model.mtp_num_layers=1")
    with pytest.raises(ConfigError, match=r"model.mtp_num_layers=1 \(the source has none; MTP "
                                          r"layers are not added to a pretrained model here\)"):
        pretrained.apply_source(cfg, overrides=["model.mtp_num_layers=1"])
    # A checkpoint of this project as the source; model=NAME gives all of that group's fields.
    cfg = make_cfg(f"checkpoint.pretrained={hf / 'gpt2_ckpt'}", "model=llama_tiny")
    with pytest.raises(ConfigError) as refused:
        pretrained.apply_source(cfg, overrides=["model=llama_tiny"])
    assert "model.hidden_size=72 (the source has 64)" in str(refused.value)
    assert "model.normalization=RMSNorm (the source has 'LayerNorm')" in str(refused.value)
    cfg = make_cfg(src, f"checkpoint.load={hf / 'llama_ckpt'}")
    with pytest.raises(ConfigError, match="give one of them"):
        pretrained.apply_source(cfg, overrides=[])
    cfg = make_cfg(src, "data.source=indexed", "data.tokenizer=external", "data.vocab_size=300",
                   "data.eod_id=0")
    with pytest.raises(ConfigError, match="vocabulary of 257 tokens.*has 300"):
        pretrained.apply_source(cfg, overrides=[])
    with pytest.raises(ConfigError, match="only local files work offline"):
        check_before_launch(make_cfg("data.tokenizer=gpt2").data)


def test_export_token_ids_of_a_byte_tokenizer_run():
    """The byte tokenizer's end of text (256) is the exported bos/eos/pad, also when the
    checkpoint records its vocabulary size (every checkpoint of gtp-recipes does)."""
    from ckpt.hf import hf_export

    data = {"tokenizer": "byte", "eod_id": None}
    assert hf_export._vocab({"vocab_size": 257}, data) == (257, 256)
    assert hf_export._token_ids({}, 256) == {"bos_token_id": 256, "eos_token_id": 256,
                                             "pad_token_id": 256}
