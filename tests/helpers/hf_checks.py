"""What the Hugging Face import tests share (tests/test_hf_import.py,
tests/test_hf_import_moe.py, tests/test_hf_import_deepseek.py, tests/test_hf_fine_tune.py): a
byte-level BPE tokenizer, an import refused for a changed ``config.json``, a model dir's tensors
compared bit for bit, and (worker-side, inside a :func:`multiproc.run_distributed` world) a
``checkpoint.pretrained`` run's model as its workers build it and megatron's logits of it,
gathered whole, to compare with transformers'."""

from __future__ import annotations

import json
import shutil

import pytest
import torch


def assert_import_refused(hf_root, src: str, change: dict, match: str, out_root, out: str):
    """``ckpt.hf.hf_import.import_hf`` of a copy of ``hf_root/src`` whose ``config.json`` has
    ``change`` raises ``HFImportError`` matching ``match`` and writes no checkpoint under
    ``out_root/out``."""
    from ckpt.hf import hf_import

    bad = out_root / f"{src}_{out}"
    shutil.copytree(hf_root / src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(hf_import.HFImportError, match=match):
        hf_import.import_hf(bad, out_root / out)
    assert not (out_root / out / "iter_0000000").exists()


def dir_tensors(d) -> dict:
    """``{name: tensor}`` of every safetensors file in the model dir ``d``."""
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(f"{d}/*.safetensors"):
        out.update(load_file(f))
    return out


def assert_same_tensors(src, back) -> None:
    """The model dirs ``src`` and ``back`` hold the same tensor names, each of the same dtype
    and bit for bit equal."""
    src, back = dir_tensors(src), dir_tensors(back)
    assert sorted(src) == sorted(back)
    for key, tensor in src.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def logits_world(cfgs: dict, vocab: int, seq: int) -> dict:
    """Worker side: ``{name: (tokens, megatron's logits)}`` of each resolved config of ``cfgs``
    (``{name: yaml}``, ``checkpoint.pretrained`` prepared) on the same random ``[2, seq]``
    tokens below ``vocab``; megatron's groups dropped after the last."""
    from multiproc import reset_model_parallel

    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, cfg_yaml in cfgs.items():
        model = pretrained_run(cfg_yaml)[2]
        out[name] = (tokens, megatron_logits(model, tokens))
    reset_model_parallel()
    return out


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


def pretrained_run(cfg_yaml: str) -> tuple:
    """``(cfg, tokenizer, model, optimizer, scheduler)`` of a resolved config whose
    ``checkpoint.pretrained`` is prepared (``recipes.run.pretrained.prepare``): megatron's groups
    rebuilt, the model built by ``recipes.run.worker.setup`` and the source's weights loaded."""
    from omegaconf import OmegaConf

    from multiproc import reset_model_parallel
    from recipes.run import pretrained, worker
    from recipes.config.validate import validate

    reset_model_parallel()
    cfg = OmegaConf.create(cfg_yaml)
    tokenizer, model, optimizer, scheduler = worker.setup(
        cfg, validate(cfg, torch.distributed.get_world_size()))
    pretrained.load_weights(cfg, model, optimizer)
    return cfg, tokenizer, model, optimizer, scheduler


def byte_bpe(vocab: int = 257):
    """A byte-level BPE (``tokenizers.Tokenizer``) of ``vocab`` tokens: ``<|endoftext|>`` (id 0)
    and the 256 byte symbols, trained on one phrase."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world"], trainer)
    assert tok.get_vocab_size() == vocab
    return tok
