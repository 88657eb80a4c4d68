"""data=chat (recipes/data/chat.py) without processes: the loss mask against transformers' own,
packing's positions and attention mask, the cache, and the one-line refusals before launch."""

from __future__ import annotations

import json
import os

import pytest
import torch
from chat_data import CHATML, FIXTURE, THINK_LAST, VOCAB, conversations, write_chat_tokenizer
from compose import make_cfg

from recipes.data import chat
from recipes.config.errors import ConfigError
from recipes.config.prelaunch import check


def check_chat(cfg):
    """What ``train.py`` runs before it starts a process (``recipes.config.prelaunch.check``)."""
    return check(cfg, choices={})


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return chat.load_template_tokenizer(make_cfg("data=chat", f"data.tokenizer={tok_dir}").data)


def chat_cfg(tok_dir, tmp_path, *overrides, paths=(FIXTURE,)):
    return make_cfg("data=chat", f"data.tokenizer={tok_dir}", f"data.cache_dir={tmp_path}",
                    f"data.paths=[{','.join(str(p) for p in paths)}]", *overrides)


def test_mask_covers_exactly_the_assistant_tokens(tok):
    """The mask derived by rendering prefixes of plain ChatML, against transformers'
    ``return_assistant_tokens_mask`` of the same template with ``{% generation %}`` markers: the
    same ids and the same mask on every conversation, multi-turn and with a system turn
    included; the masked text is each assistant reply and its end-of-turn token."""
    convs = conversations()
    assert any(len(c) > 3 for c in convs) and any(c[0]["role"] == "system" for c in convs)
    for messages in convs:
        ids, mask = chat.render(tok, messages)
        ref = tok.apply_chat_template(messages, chat_template=CHATML, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"]), messages
        assert mask == list(ref["assistant_masks"]), messages
        masked = tok.decode([i for i, m in zip(ids, mask) if m])
        assert masked == "".join(m["content"] + "<|im_end|>\n" for m in messages
                                 if m["role"] == "assistant")


def test_a_template_with_generation_markers_places_turns_the_prefix_rule_cannot(tok):
    """Qwen3-like: an empty think block in the last assistant turn only. Without markers a
    multi-turn conversation is refused naming it; with them transformers' spans are the mask."""
    import copy

    messages = next(c for c in conversations() if sum(m["role"] == "assistant" for m in c) > 1)
    marked = copy.copy(tok)
    marked.chat_template = THINK_LAST
    ids, mask = chat.render(marked, messages, "chat.jsonl: conversation 3")
    ref = marked.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert ids == list(ref["input_ids"])
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "".join(m["content"] + "<|im_end|>\n" for m in messages
                             if m["role"] == "assistant")
    plain = copy.copy(tok)
    plain.chat_template = THINK_LAST.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    with pytest.raises(ValueError, match=r"chat.jsonl: conversation 3: the chat template renders "
                                         r"the turns before assistant message 1 differently .* "
                                         r"\{% generation %\}"):
        chat.render(plain, messages, "chat.jsonl: conversation 3")


def test_prompt_completion_rows_are_a_user_and_an_assistant_turn(tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text('{"prompt": "Hi?", "completion": "Hello."}\n')
    assert list(chat.read_conversations(str(path))) == [
        [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]]


def test_packing_restarts_positions_and_masks_across_conversations():
    examples = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1]),
                ([8, 9, 10, 11, 12], [0, 0, 0, 0, 1])]
    packed = chat.pack(examples, 8, True, pad_id=0)
    # 3 + 2 positions fit in 8; the third conversation's 4 do not: a second sample.
    assert packed["segments"].tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert packed["tokens"][0].tolist() == [1, 2, 3, 5, 6, 0, 0, 0]
    assert packed["labels"][0].tolist() == [2, 3, 4, 6, 7, 0, 0, 0]
    assert packed["loss_mask"][0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    seg = torch.tensor(packed["segments"][0], dtype=torch.int64)
    assert chat.position_ids(seg).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    mask = chat.attention_mask(seg)[0]
    for q in range(8):
        for k in range(8):
            sees = bool(seg[q] == seg[k]) and k <= q
            assert bool(mask[q, k]) == (not sees), (q, k)
    unpacked = chat.pack(examples, 8, False, pad_id=0)
    assert unpacked["segments"].shape == (3, 8)


def test_cache_once_keyed_and_the_samples_fixed_by_the_seed(tok_dir, tmp_path, capsys):
    cfg = chat_cfg(tok_dir, tmp_path, "data.chat_packing=true", "data.split=90/10/0")
    out = chat.prepare_chat(cfg.data, 128, pad_id=0)
    assert "> tokenized chat data into" in capsys.readouterr().out
    assert chat.prepare_chat(cfg.data, 128, pad_id=0) == out  # read back, not rebuilt
    assert "> tokenized" not in capsys.readouterr().out
    meta = json.loads(open(os.path.join(out, "meta.json")).read())
    assert meta["conversations"] == len(conversations()) and meta["packing"]
    assert meta["samples"]["train"] < meta["conversations"]  # packed several to a sample
    other = chat.prepare_chat(chat_cfg(tok_dir, tmp_path, "data.split=90/10/0").data, 128, 0)
    assert other != out  # chat_packing is part of the key
    a, b = (chat.ChatDataset(out, "train", 20, seed=3) for _ in range(2))
    assert [a.row(i) for i in range(20)] == [b.row(i) for i in range(20)]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_failed_build_leaves_nothing_in_the_cache(tok_dir, tmp_path, monkeypatch):
    saved, savez = [], chat.numpy.savez

    def savez_then_crash(path, **arrays):  # train.npz written, then validation.npz fails
        if saved:
            raise OSError("disk full")
        saved.append(path)
        savez(path, **arrays)

    monkeypatch.setattr(chat.numpy, "savez", savez_then_crash)
    with pytest.raises(OSError, match="disk full"):
        chat.prepare_chat(chat_cfg(tok_dir, tmp_path, "data.split=90/10/0").data, 128, 0)
    assert saved and os.listdir(tmp_path) == []  # the half-written build removed, none renamed


def test_overlong_conversations_are_cut_or_dropped_and_counted(tok_dir, tmp_path):
    for how, field in (("truncate", "truncated"), ("drop", "dropped")):
        cfg = chat_cfg(tok_dir, tmp_path / how, f"data.chat_overlong={how}", "data.split=100/0/0")
        out = chat.prepare_chat(cfg.data, 24, 0)
        meta = json.loads(open(os.path.join(out, "meta.json")).read())
        assert meta[field] > 0, meta
        assert meta["conversations"] + meta["dropped"] + meta["no_loss"] == len(conversations())


BAD = {
    "no_messages": ('{"text": "hi"}', r":2: no 'messages' list \(found \['text'\]\); write"),
    "unknown_role": ('{"messages": [{"role": "bot", "content": "x"}]}',
                     r":2: message 0 has role 'bot'; valid roles are \('system', 'user', "
                     r"'assistant'\)"),
    "no_assistant": ('{"messages": [{"role": "user", "content": "x"}]}',
                     r":2: no assistant turn, so nothing to learn; add one or drop the line"),
    "not_json": ('{"messages": [', r":2: not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rows_get_one_line_naming_the_file_and_line(tok_dir, tmp_path, case):
    line, message = BAD[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=str(path).replace(".", r"\.") + message) as err:
        check_chat(chat_cfg(tok_dir, tmp_path, paths=[path]))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError):  # the build refuses it too, writing nothing
        chat.prepare_chat(chat_cfg(tok_dir, tmp_path, paths=[path]).data, 128, 0)
    assert [n for n in os.listdir(tmp_path) if n.startswith("chat_")] == []


def test_an_empty_file_and_a_tokenizer_without_template_are_refused(tok_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=f"{empty}: empty, no conversation; give a .jsonl"):
        check_chat(chat_cfg(tok_dir, tmp_path, paths=[empty]))
    plain = write_chat_tokenizer(tmp_path / "plain", template=None)
    with pytest.raises(ConfigError, match=r"has no chat template .* set data.chat_template="):
        check_chat(chat_cfg(plain, tmp_path))
    with pytest.raises(ConfigError, match="data.source='chat': conversations are rendered with a "):
        check_chat(make_cfg("data=chat", f"data.paths=[{FIXTURE}]", "data.tokenizer=byte"))


def test_text_data_given_a_chat_file_names_data_chat_before_launch():
    with pytest.raises(ConfigError, match=r"chat.jsonl:1: a conversation \(\['messages'\]\), not "
                                          r"text .* data=chat data.tokenizer="):
        check_chat(make_cfg("data=text", f"data.paths=[{FIXTURE}]"))


def test_packing_is_refused_where_the_mask_would_not_reach_attention(tok_dir, tmp_path):
    cfg = chat_cfg(tok_dir, tmp_path, "data.chat_packing=true",
                   "model.transformer_impl=transformer_engine")
    with pytest.raises(ConfigError, match="THD packed_seq_params with cu_seqlens"):
        check_chat(cfg)


def test_a_resume_with_other_chat_fields_is_refused():
    from recipes.checkpoint.policy import resume_changes

    old = {"data": {"source": "text", "paths": ["a.jsonl"]}}  # written before data=chat
    same = {"data": {"source": "text", "paths": ["a.jsonl"], "chat_template": None,
                     "chat_overlong": "truncate", "chat_packing": False, "valid_paths": [],
                     "chat_split": "train", "chat_valid_split": "validation"}}
    assert resume_changes(old, same, 0) == []
    changed = {"data": {**same["data"], "chat_template": "other.jinja"}}
    (change,) = resume_changes(same, changed, 0)
    assert change.field == "data.chat_template" and change.effect.startswith("REFUSED")


def test_vocab_of_the_test_tokenizer(tok):
    assert len(tok) == VOCAB


def test_export_keeps_the_chat_template(tok_dir, tmp_path):
    """``gtp export`` of a chat fine-tune writes the template it trained with, so
    ``AutoTokenizer`` of the exported dir renders conversations as training did."""
    from transformers import AutoTokenizer

    from ckpt.hf.hf_export import _copy_tokenizer

    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    out = tmp_path / "export"
    out.mkdir()
    names = _copy_tokenizer({"tokenizer": str(tok_dir), "chat_template": str(template)}, out, {})
    assert "chat_template.jinja" in names
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "user: hi\n"


def test_iterators_give_masked_packed_batches_and_the_validation_file(tok_dir, tmp_path):
    """The train iterator and the validation set of a packed chat run (one process): batches
    carry the block-diagonal ``attention_mask`` beside megatron's four keys; validation comes
    from ``data.valid_paths`` when given."""
    from recipes.data import build_iterators

    valid = tmp_path / "valid.jsonl"
    valid.write_text("\n".join(FIXTURE.read_text().splitlines()[:6]) + "\n")
    cfg = chat_cfg(tok_dir, tmp_path, "data.chat_packing=true", f"data.valid_paths=[{valid}]",
                   "data.micro_batch_size=2", "data.global_batch_size=4", "train.eval_iters=1",
                   "train.train_iters=3", "model.seq_length=128")
    train, validation = build_iterators(cfg, 4, 0, 1)
    batch = next(train)
    assert sorted(batch) == ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]
    assert batch["attention_mask"].shape == (2, 1, 128, 128)
    assert batch["tokens"].shape == (2, 128) and batch["loss_mask"].sum() > 0
    assert len(train) == 2 * 2  # iterations 2 and 3 of 3, two micro-batches each
    meta = json.loads(open(os.path.join(train.dataset.out_dir, "meta.json")).read())
    assert meta["validation_inputs"] == [str(valid)] and meta["samples"]["validation"] >= 2
    assert len(list(iter(validation))) == 2
