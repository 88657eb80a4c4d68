"""A Hugging Face dir runs none of its own code: ``config.json`` is read as JSON and checked
before ``transformers`` reads it (an unknown ``model_type`` or any ``auto_map`` refused in one
message naming the value and the importable model types), ``transformers`` loads with
``trust_remote_code=False``, and a tokenizer dir whose ``tokenizer_config.json`` has an
``auto_map`` is refused (``python -m gtp import``, ``checkpoint.pretrained``, ``data.tokenizer``).
Crafted dirs, no weights: each dir's ``configuration_evil.py`` creates a marker file if imported."""

from __future__ import annotations

import json

import pytest

from ckpt import families
from ckpt.hf import hf_import

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 257}
AUTO_MAP = {"AutoConfig": "configuration_evil.EvilConfig"}


def _hf_dir(tmp_path, config: dict, tokenizer_config: dict | None = None):
    d = tmp_path / "hf"
    d.mkdir()
    marker = tmp_path / "marker"
    (d / "config.json").write_text(json.dumps(config))
    (d / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return d, marker


def _refused(d, marker, *parts: str) -> str:
    with pytest.raises(hf_import.HFImportError) as info:
        hf_import.read_config(d)
    text = str(info.value)
    assert "\n" not in text and not marker.exists(), text
    for part in parts:
        assert part in text, (part, text)
    return text


def test_an_unknown_model_type_with_an_auto_map_is_refused_before_transformers_reads_it(
        tmp_path, monkeypatch):
    """transformers would ask "Do you wish to run the custom code? [y/N]" on a terminal; here
    it is never asked (its reader is not reached), whatever the answer would be."""
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("transformers read the config")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", never)
    d, marker = _hf_dir(tmp_path, {"model_type": "evil", "auto_map": AUTO_MAP})
    _refused(d, marker, "model_type='evil', which is not importable",
             " or ".join(families.importable()))


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_an_auto_map_is_refused_for_an_importable_model_type(where, tmp_path):
    """A Llama config with an ``auto_map`` (transformers would read it with its own Llama class
    and say nothing), or a ``tokenizer_config.json`` beside it with one."""
    config = {**LLAMA, "auto_map": AUTO_MAP} if where == "config.json" else LLAMA
    tokenizer = {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}
    d, marker = _hf_dir(tmp_path, config, tokenizer if where != "config.json" else None)
    _refused(d, marker, f"{d / where}: auto_map=", "trust_remote_code=False")


def test_transformers_reads_with_trust_remote_code_false(tmp_path, monkeypatch):
    import transformers

    seen = {}
    real = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    d, marker = _hf_dir(tmp_path, LLAMA)
    kind, config = hf_import.read_config(d)
    assert kind == "llama" and config.num_hidden_layers == 2
    assert seen.get("trust_remote_code") is False and seen.get("local_files_only"), seen


def test_a_tokenizer_dir_with_an_auto_map_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    from recipes.data import HFTokenizer

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(str(tmp_path)).vocab_size == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        with pytest.raises(ValueError, match=rf"data.tokenizer='{path}': .*auto_map="):
            HFTokenizer(str(path))
