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


def test_a_conversation_opening_with_the_assistant_keeps_its_header_out_of_the_loss(tok):
    """An assistant greeting first: its role header is the template's, not the reply's (the
    prefix before it is the empty conversation's generation prompt), as transformers' markers
    say."""
    messages = [{"role": "assistant", "content": "Hi, how can I help?"},
                {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."}]
    ids, mask = chat.render(tok, messages)
    ref = tok.apply_chat_template(messages, chat_template=CHATML, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"])
    assert mask == list(ref["assistant_masks"])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == \
        "Hi, how can I help?<|im_end|>\n4.<|im_end|>\n"


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
    "tool_calls": ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", '
                   '"content": null, "tool_calls": [{"function": {"name": "f"}}]}]}',
                   r":2: message 1 \(assistant\) holds 'tool_calls': tool calls are not "
                   r"supported; write the call as the 'content' string or drop the line"),
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


ALTERNATING = ("{%- for m in messages %}{%- if loop.index0 > 0 and m['role'] == "
               "messages[loop.index0 - 1]['role'] %}{{ raise_exception('Conversation roles must "
               "alternate user/assistant/user/assistant/...') }}{%- endif %}"
               "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
               "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
               "{%- endif %}")


def test_a_conversation_the_template_refuses_is_one_line_naming_its_line(tmp_path):
    """A Llama-2/Mistral-style template raising on two assistant turns in a row: a refusal
    (one line in a worker too, no traceback) naming the file's line and the template's words."""
    tok = write_chat_tokenizer(tmp_path / "tok", template=ALTERNATING)
    path = tmp_path / "turns.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n\n" + json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"}]}) + "\n")
    with pytest.raises(ConfigError, match=str(path).replace(".", r"\.") + r":3: the chat "
                       r"template cannot render this conversation \(TemplateError: Conversation "
                       r"roles must alternate .*data.chat_template=") as err:
        chat.prepare_chat(chat_cfg(tok, tmp_path / "cache", paths=[path]).data, 128, 0)
    assert "\n" not in str(err.value)


def _rank0_refuses(_):
    from recipes.data.datasets import _rank0_first

    def prepare():
        raise ConfigError("bad.jsonl:3: refused")
    try:
        _rank0_first(prepare)
    except Exception as err:  # noqa: BLE001 - what each rank raised
        return type(err).__name__, str(err)


def test_when_rank_0_refuses_the_data_the_other_ranks_refuse_as_its_consequence():
    """Each rank then exits without a traceback (a refusal), and the launcher, which leaves out
    a rank whose error says "failed on another rank", prints rank 0's line alone."""
    from multiproc import run_distributed

    (kind0, text0), (kind1, text1) = run_distributed(_rank0_refuses, 2, None)
    assert (kind0, text0) == ("ConfigError", "bad.jsonl:3: refused")
    assert kind1 == "ConfigError" and "failed on another rank" in text1


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


def test_too_few_conversations_for_the_validation_split_are_refused_before_launch(tok_dir,
                                                                                   tmp_path):
    """data=chat's defaults (data.split=98,2,0, train.eval_iters > 0) on 5 conversations leave
    validation none: refused before launch, with the ways out, not by the worker."""
    path = tmp_path / "five.jsonl"
    path.write_text("\n".join(FIXTURE.read_text().splitlines()[:5]) + "\n")
    cfg = chat_cfg(tok_dir, tmp_path, paths=[path])
    assert cfg.train.eval_iters > 0 and not cfg.data.valid_paths
    with pytest.raises(ConfigError, match=r"data.split='98,2,0' gives the validation split none "
                                          r"of the 5 document\(s\) of data.paths \(a conversation "
                                          r"is a document\).*train.eval_iters=0.*data.split=90/10/0"
                                          r".*data.valid_paths=") as err:
        check_chat(cfg)
    assert "\n" not in str(err.value)
    check_chat(chat_cfg(tok_dir, tmp_path, "train.eval_iters=0", paths=[path]))
    check_chat(chat_cfg(tok_dir, tmp_path, f"data.valid_paths=[{path}]", paths=[path]))


def test_nothing_left_after_truncation_names_the_ways_that_can_help(tok_dir, tmp_path):
    """Every conversation cut before its first assistant token (data.chat_overlong=truncate
    already): the refusal does not tell the user to set truncate."""
    path = tmp_path / "long_prompt.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "word " * 200},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
    cfg = chat_cfg(tok_dir, tmp_path, "data.split=100/0/0", paths=[path])
    with pytest.raises(ConfigError, match=r"is left for training .* raise model.seq_length=24, "
                                          r"or shorten the turns before the first assistant") as e:
        chat.prepare_chat(cfg.data, 24, 0)
    assert "data.chat_overlong=truncate" not in str(e.value)
    drop = chat_cfg(tok_dir, tmp_path, "data.split=100/0/0", "data.chat_overlong=drop",
                    paths=[path])
    with pytest.raises(ConfigError, match=r"or set data.chat_overlong=truncate"):
        chat.prepare_chat(drop.data, 24, 0)


def test_a_resume_by_checkpoint_load_alone_keeps_the_runs_seed_per_token_loss_and_eval():
    """A packed chat fine-tune (train.seed=7, calculate_per_token_loss, data.split=100/0/0 with
    train.eval_iters=0) resumed by checkpoint.load=DIR alone: the data fields come from the
    checkpoint, and so must these, else the seed is refused as a data change, the loss silently
    goes per micro-batch and the taken data.split is refused for the default eval_iters."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from recipes.checkpoint import policy as checkpointer

    saved = make_cfg("data=chat", "data.tokenizer=/tok", f"data.paths=[{FIXTURE}]",
                     "data.split=100/0/0", "train.eval_iters=0", "train.seed=7",
                     "train.calculate_per_token_loss=true", "data.chat_packing=true")
    plan = SimpleNamespace(path="/ck/iter_0000002", common={"train_state": {"config": {
        group: OmegaConf.to_container(saved[group]) for group in ("model", "data", "train")}}})
    cfg = make_cfg("train.train_iters=8")
    note = checkpointer.take_checkpoint_fields(cfg, plan, overrides=["train.train_iters=8"])
    assert (cfg.train.seed, cfg.train.calculate_per_token_loss, cfg.train.eval_iters) == (
        7, True, 0), note
    assert cfg.train.train_iters == 8 and cfg.data.source == "chat"
    given = make_cfg("train.eval_iters=3")
    checkpointer.take_checkpoint_fields(given, plan, overrides=["train.eval_iters=3"])
    assert given.train.eval_iters == 3 and given.train.seed == 7  # a given field kept


def test_export_from_elsewhere_says_the_trained_template_is_missing(tok_dir, tmp_path,
                                                                     monkeypatch):
    """A run's relative data.chat_template (or one deleted since) that the export cannot find:
    the tokenizer dir's own chat_template.jinja is not written in its place, and gtp export
    says in one line that the trained template is missing."""
    import argparse
    import io
    import shutil

    from ckpt import cli
    from ckpt.hf import hf_export

    tok = tmp_path / "tok"
    shutil.copytree(tok_dir, tok)
    (tok / "chat_template.jinja").write_text("{{ 'the tokenizer dir own template' }}")
    data = {"tokenizer": str(tok), "chat_template": "relative/trained.jinja"}
    out = tmp_path / "export"
    out.mkdir()
    names = hf_export._copy_tokenizer(data, out, {})
    assert "tokenizer.json" in names and "chat_template.jinja" not in names
    assert hf_export.chat_template_not_found(data) == "relative/trained.jinja"
    assert hf_export.chat_template_not_found({"chat_template": str(tok / "chat_template.jinja")}
                                             ) is None
    (out / "gtp_recipes_export.json").write_text(json.dumps({
        "architecture": "GPT2LMHeadModel", "vocab_size": VOCAB, "iteration": 2, "source": "/ck",
        "tokenizer_files": names, "chat_template_not_found": "relative/trained.jinja"}))
    monkeypatch.setattr(hf_export, "export", lambda *a, **k: out)
    printed = io.StringIO()
    args = argparse.Namespace(ckpt="/ck", out=str(out), layout=None, force=False)
    assert cli.cmd_export(args, out=printed) == 0
    note = [line for line in printed.getvalue().splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "data.chat_template='relative/trained.jinja' is not a file" in \
        note[0], printed.getvalue()


REASONING = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
             "{%- if m.reasoning_content is defined %}{{- '<think>' + m.reasoning_content + "
             "'</think>' }}{%- endif %}{{- m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_messages_other_keys_reach_the_template(tmp_path):
    """Qwen3's template renders an assistant turn's ``reasoning_content`` in a think block: the
    key is handed to the template (it was dropped, so reasoning traces silently left training),
    and the trace is in the loss with its answer."""
    from transformers import AutoTokenizer

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "two and two"}]}) + "\n")
    [messages] = chat.read_conversations(str(path))
    assert messages[1]["reasoning_content"] == "two and two"
    tok = AutoTokenizer.from_pretrained(write_chat_tokenizer(tmp_path / "tok", REASONING))
    ids, mask = chat.render(tok, messages)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == \
        "<think>two and two</think>4.<|im_end|>\n"


def test_packing_without_per_token_loss_says_how_tokens_are_weighed(tok_dir, tmp_path, capsys):
    check_chat(chat_cfg(tok_dir, tmp_path, "data.chat_packing=true"))
    assert "> note: data.chat_packing=true with train.calculate_per_token_loss=false" in \
        capsys.readouterr().out
    check_chat(chat_cfg(tok_dir, tmp_path, "data.chat_packing=true",
                        "train.calculate_per_token_loss=true"))
    assert "note" not in capsys.readouterr().out
