"""data=chat from a dataset saved with the ``datasets`` library (recipes/data/chat_saved.py):
the same samples as its ``.jsonl``, a DatasetDict's split by ``data.chat_split``, the cache
keyed by the directory's files, and the one-line refusals (row index, a non-local name)."""

from __future__ import annotations

import json
import os

import shutil

import datasets
import numpy
import pytest
from chat_data import FIXTURE, write_chat_tokenizer
from compose import make_cfg

from recipes.data import chat
from recipes.config.errors import ConfigError
from recipes.config.prelaunch import check


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


def rows():
    """Some of the fixture's conversations: multi-turn, with system turns, prompt/completion."""
    every = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    assert "prompt" in every[-1] and "prompt" not in every[0]
    return every[:6] + every[-2:]


def table(records: list) -> datasets.Dataset:
    """``records`` as one table: every row has every column (None where a row has none), as
    ``load_dataset("json", ...)`` gives a file mixing messages and prompt/completion rows."""
    keys = sorted({k for r in records for k in r})
    return datasets.Dataset.from_dict({k: [r.get(k) for r in records] for k in keys})


def chat_cfg(tok_dir, tmp_path, *overrides, paths=(FIXTURE,)):
    return make_cfg("data=chat", f"data.tokenizer={tok_dir}", f"data.cache_dir={tmp_path}",
                    f"data.paths=[{','.join(str(p) for p in paths)}]", *overrides)


def arrays(out: str) -> dict:
    return {split: dict(numpy.load(os.path.join(out, f"{split}.npz")))
            for split in ("train", "validation")}


def test_a_saved_dataset_gives_the_jsonls_samples_and_keys_the_cache(tok_dir, tmp_path):
    """A ``save_to_disk`` dir of the fixture's rows (messages and prompt/completion rows in one
    table) gives the samples of the ``.jsonl`` itself; a DatasetDict's split is chosen by
    ``data.chat_split``; the saved files key the cache (re-saved with one row less: rebuilt)."""
    saved = tmp_path / "saved"
    table(rows()).save_to_disk(str(saved))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    split = ("data.split=75/25/0", "data.chat_packing=true")
    want = arrays(chat.prepare_chat(chat_cfg(tok_dir, tmp_path / "c", *split, paths=[jsonl]
                                             ).data, 128, 0))
    assert want["validation"]["tokens"].shape[0] > 0
    out = chat.prepare_chat(chat_cfg(tok_dir, tmp_path / "c", *split, paths=[saved]).data, 128, 0)
    got = arrays(out)
    for name in want:
        for key in want[name]:
            numpy.testing.assert_array_equal(got[name][key], want[name][key], err_msg=key)
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": table(rows()[:3]),
                          "test": table(rows())}).save_to_disk(str(both))
    cfg = chat_cfg(tok_dir, tmp_path / "c", *split, "data.chat_split=test", paths=[both])
    check(cfg, choices={})
    numpy.testing.assert_array_equal(arrays(chat.prepare_chat(cfg.data, 128, 0))["train"]
                                     ["tokens"], got["train"]["tokens"])
    with pytest.raises(ConfigError, match=r"data.paths\[0\]=.*: the DatasetDict in .* has no "
                                          r"split 'train2'; its splits are \['train', 'test'\]"):
        check(chat_cfg(tok_dir, tmp_path / "c", "data.chat_split=train2", paths=[both]),
              choices={})
    shutil.rmtree(saved)
    table(rows()[:-1]).save_to_disk(str(saved))
    rebuilt = chat.prepare_chat(chat_cfg(tok_dir, tmp_path / "c", *split, paths=[saved]).data,
                                128, 0)
    assert rebuilt != out


def test_bad_saved_data_gets_one_line(tok_dir, tmp_path):
    """A bad row names the dataset dir and the row index; an empty dataset, a directory that
    is not a saved dataset and a Hub name (nothing is downloaded) are refused in one line."""
    bad = tmp_path / "bad"
    table([rows()[0], {"messages": [{"role": "bot", "content": "x"}]}]
                               ).save_to_disk(str(bad))
    cases = [
        (bad, rf"{bad}: row 1: message 0 has role 'bot'; valid roles are"),
        (tmp_path / "plain_dir",
         r"is not a dataset saved with the datasets library \(no state.json or "
         r"dataset_dict.json\); save one with dataset.save_to_disk\(DIR\)"),
        ("HuggingFaceH4/ultrachat_200k",
         r"data.paths\[0\]='HuggingFaceH4/ultrachat_200k': no such local file or directory .* "
         r"\(nothing is downloaded: for a Hugging Face Hub dataset, save it with "
         r"load_dataset\(...\).save_to_disk\(DIR\) and give DIR\)"),
    ]
    (tmp_path / "plain_dir").mkdir()
    empty = tmp_path / "empty"
    table(rows()[:1]).select([]).save_to_disk(str(empty))
    cases.append((empty, rf"{empty}: an empty dataset \('train'\), no conversation"))
    for path, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            check(chat_cfg(tok_dir, tmp_path / "c", paths=[path]), choices={})
        assert "\n" not in str(err.value)
    assert not (tmp_path / "c").exists()  # nothing half-written in the cache
