"""Chat fine-tuning data (``data=chat``): conversations rendered with the tokenizer's chat template,
the loss on the assistant turns only, optionally packed, tokenized once into the cache.

* Input: ``.jsonl`` files, one conversation a line: ``{"messages": [{"role": ..., "content":
  ...}, ...]}`` (roles ``system``, ``user``, ``assistant``) or ``{"prompt": ..., "completion":
  ...}`` (a user turn and an assistant turn), or directories saved with the ``datasets`` library
  holding such rows (:mod:`recipes.data.chat_saved`). :func:`read_conversations` checks every
  row and names the file, the line (or row index) and the fix of the first bad one.
* Rendering: transformers' ``apply_chat_template`` of the Hugging Face tokenizer in
  ``data.tokenizer`` (its ``chat_template``; ``data.chat_template`` names a ``.jinja`` file
  instead). The loss mask is derived by rendering prefixes: the text of assistant turn ``i`` is
  ``render(messages[:i+1])`` minus ``render(messages[:i], add_generation_prompt=True)`` (its
  content and the end-of-turn token); the full text is tokenized once and a token is in the loss
  when its first character lies in such a span (its offset mapping). A template that marks the
  assistant turns with ``{% generation %}`` gets transformers' ``return_assistant_tokens_mask``.
* Samples: a conversation of ``n`` ids gives ``n - 1`` positions (tokens ``ids[:-1]``, labels
  ``ids[1:]``, the loss mask of the labels). Longer than ``model.seq_length`` positions: cut
  (``data.chat_overlong=truncate``) or left out (``drop``), counted in the log. Unpacked, a sample
  is one conversation padded to ``seq_length`` (loss mask 0 on the padding). Packed
  (``data.chat_packing=true``), conversations fill samples in file order (a conversation that does
  not fit starts the next sample), each attending only within itself (a block-diagonal causal
  ``attention_mask``, True = masked out, megatron's local attention convention) with
  ``position_ids`` restarting at 0.
* Cache: ``<cache_dir>/chat_<key>/{train,validation}.npz`` + ``meta.json``, the key hashing the
  files (path, mtime, size), the tokenizer, the template, ``seq_length`` and the packing fields;
  written under a temporary name and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from typing import Any, Iterator

import numpy

from gtp.progress import progress
from recipes.data.chat_dataset import ChatDataset, attention_mask, position_ids  # noqa: F401
from recipes.data.chat_saved import check_saved_dataset, input_stats, saved_rows
from recipes.data.corpus import resolved_cache_dir
from recipes.data.tokenizers import is_tokenizer_path
from recipes.config.errors import ConfigError

ROLES = ("system", "user", "assistant")
OVERLONG = ("truncate", "drop")
# 2: an assistant-first conversation's header out of the mask; 3: a message's other keys rendered
CHAT_FORMAT_VERSION = 3
_FORM = ('{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
         '"content": "..."}]} or {"prompt": "...", "completion": "..."}')


def check_chat_paths(data_cfg: Any, key: str = "paths") -> list[str]:
    """``data.<key>`` as absolute ``.jsonl`` files or saved dataset directories, after checking
    each exists locally (ValueError / FileNotFoundError naming it: nothing is downloaded)."""
    paths = list(data_cfg.get(key) or [])
    if not paths and key == "paths":
        raise ValueError(f"data.paths is empty: data.source='chat' needs .jsonl files of {_FORM}")
    files = []
    for i, p in enumerate(paths):
        path = os.path.abspath(os.path.expanduser(str(p)))
        if os.path.isdir(path):
            check_saved_dataset(path, _split_of(data_cfg, key), f"data.{key}[{i}]={p!r}")
        elif not os.path.exists(path):
            raise FileNotFoundError(
                f"data.{key}[{i}]={p!r}: no such local file or directory {path} (nothing is "
                f"downloaded: for a Hugging Face Hub dataset, save it with "
                f"load_dataset(...).save_to_disk(DIR) and give DIR)")
        elif not path.endswith(".jsonl"):
            raise ValueError(f"data.{key}[{i}]={p!r}: data.source='chat' reads .jsonl files "
                             f"(one conversation a line: {_FORM}) or datasets' save_to_disk "
                             f"directories")
        files.append(path)
    return files


def _split_of(data_cfg: Any, key: str) -> str:
    """The ``DatasetDict`` split read for ``data.<key>``."""
    return str(data_cfg.get("chat_split" if key == "paths" else "chat_valid_split") or "train")


def _messages_of(record: Any, where: str) -> list[dict]:
    """The messages of one JSONL record, checked (ValueError naming ``where`` and the fix)."""
    if isinstance(record, dict) and record.get("messages") is None and "prompt" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings; "
                             f"write {_FORM}")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        found = (sorted(k for k, v in record.items() if v is not None)
                 if isinstance(record, dict) else type(record).__name__)
        raise ValueError(f"{where}: no 'messages' list (found {found}); write {_FORM}")
    messages = record["messages"]
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"{where}: message {k} has role {role!r}; valid roles are {ROLES}")
        if m.get("tool_calls") is not None:
            raise ValueError(f"{where}: message {k} ({m['role']}) holds 'tool_calls': tool calls "
                             f"are not supported; write the call as the 'content' string or "
                             f"drop the line")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {k} ({m['role']}) has no string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing to learn; add one or drop "
                         f"the line")
    # Other keys reach the template (Qwen3's renders an assistant turn's 'reasoning_content').
    return [dict(m) for m in messages]


def read_conversations(path: str, split: str = "train") -> Iterator[list[dict]]:
    """The conversations of one ``.jsonl`` file (blank lines skipped) or saved dataset directory
    (its ``split`` for a ``DatasetDict``), each checked.

    Raises:
        ValueError: ``<path>:<line>: <what is wrong>; <the fix>`` for the first bad line
            (``<path>: row <index>: ...`` for a saved dataset), or an empty file or dataset.
    """
    for _, messages in _located_conversations(path, split):
        yield messages


def _located_conversations(path: str, split: str) -> Iterator[tuple[str, list[dict]]]:
    """``(where, messages)`` of :func:`read_conversations`: ``<path>:<line>`` or ``<path>: row
    <index>``, what a later refusal of the conversation names."""
    found = False
    if os.path.isdir(path):
        for index, row in saved_rows(path, split):
            found = True
            where = f"{path}: row {index}"
            yield where, _messages_of(row, where)
        if not found:
            raise ValueError(f"{path}: an empty dataset ({split!r}), no conversation; give rows "
                             f"of {_FORM}")
        return
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{where}: not a JSON object ({err}); write {_FORM}") from None
            found = True
            yield where, _messages_of(record, where)
    if not found:
        raise ValueError(f"{path}: empty, no conversation; give a .jsonl file of {_FORM}")


def chat_template(data_cfg: Any) -> str:
    """The chat template of ``data_cfg``, read without transformers: ``data.chat_template``'s file,
    else ``chat_template.jinja`` in the ``data.tokenizer`` directory, else the ``chat_template``
    of its ``tokenizer_config.json`` (a string, or the one named ``default`` of a list).

    Raises:
        ValueError: ``data.tokenizer`` is not a directory, or no template is found.
        FileNotFoundError: ``data.chat_template`` names no file.
    """
    name = str(data_cfg.tokenizer)
    if not is_tokenizer_path(name) or not os.path.isdir(name):
        raise ValueError(f"data.tokenizer={name!r} with data.source='chat': conversations are "
                         f"rendered with a Hugging Face tokenizer's chat template; set "
                         f"data.tokenizer=<its directory> (tokenizer.json, tokenizer_config.json)")
    given = data_cfg.get("chat_template")
    if given:
        path = os.path.abspath(os.path.expanduser(str(given)))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.chat_template={given!r}: no such file {path}")
        with open(path, encoding="utf-8") as f:
            return f.read()
    jinja = os.path.join(name, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = None
    config = os.path.join(name, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        if isinstance(template, list):
            template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not template:
        raise ValueError(f"data.tokenizer={name!r} has no chat template (no chat_template in "
                         f"tokenizer_config.json, no chat_template.jinja): add one, or set "
                         f"data.chat_template=<file.jinja>")
    return template


def load_template_tokenizer(data_cfg: Any):
    """transformers' tokenizer of ``data.tokenizer`` (local files only, no remote code) with the
    chat template of :func:`chat_template` (ValueError / FileNotFoundError as that)."""
    template = chat_template(data_cfg)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(str(data_cfg.tokenizer), local_files_only=True,
                                        trust_remote_code=False)
    tok.chat_template = template
    return tok


def _render(tok, messages: list[dict], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=generation_prompt)


_PROBE = "GTPCHATPROBE7f3a"  # a stand-in reply, found in the rendered text


def _generation_prefix(tok, messages: list[dict]) -> str:
    """The text before the next assistant turn's content: ``render(messages,
    add_generation_prompt=True)``, its role header included. For a conversation that opens with
    the assistant (transformers renders no empty conversation), what the template writes before
    the content of a lone assistant message (``""`` when it is not found)."""
    if messages:
        return _render(tok, messages, generation_prompt=True)
    text = _render(tok, [{"role": "assistant", "content": _PROBE}])
    return text[:max(text.find(_PROBE), 0)]


_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def render(tok, messages: list[dict], where: str = "") -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of one conversation: the ids of the whole rendered text and 1 where a
    token belongs to an assistant turn (its text and end-of-turn token), 0 elsewhere.

    A template with ``{% generation %}`` markers: transformers' ``return_assistant_tokens_mask``
    (the marked spans). Otherwise by rendering prefixes (the module's docstring).

    Raises:
        ValueError: a template without markers renders a conversation's beginning differently
            from the whole (the prefix rule cannot place the assistant turns).
    """
    if _GENERATION.search(tok.chat_template):
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), [int(m) for m in enc["assistant_masks"]]
    text = _render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _generation_prefix(tok, messages[:i])
        upto = _render(tok, messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(f"{where}: the chat template renders the turns before assistant "
                             f"message {i} differently from the whole conversation (e.g. a "
                             f"think block only in the last turn), so its tokens cannot be "
                             f"found; give a template that marks each assistant turn with "
                             f"{{% generation %}} ... {{% endgeneration %}} "
                             f"(data.chat_template=<file.jinja>)")
        spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _conversation_samples(tok, files, seq_length: int, overlong: str, counts: dict,
                          split: str = "train"):
    """``(ids, mask)`` of every conversation of ``files`` with at most ``seq_length + 1`` ids
    (longer ones cut or left out, counted in ``counts``)."""
    for path in files:
        for where, messages in _located_conversations(path, split):
            try:
                ids, mask = render(tok, messages, where)
            except Exception as err:  # noqa: BLE001 - the template's error, named in one line
                if str(err).startswith(where):
                    raise
                raise ValueError(f"{where}: the chat template cannot render this conversation "
                                 f"({type(err).__name__}: {err}); fix the line, or give a "
                                 f"template that accepts it (data.chat_template=<file.jinja>)"
                                 ) from None
            if len(ids) > seq_length + 1:
                if overlong == "drop":
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += 1
                ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
            if sum(mask[1:]) == 0:
                counts["no_loss"] += 1
                continue
            counts["conversations"] += 1
            yield ids, mask


def pack(examples, seq_length: int, packing: bool, pad_id: int) -> dict:
    """Samples of ``seq_length`` positions from ``examples`` (``(ids, mask)``, in order).

    Returns arrays ``[samples, seq_length]``: ``tokens``, ``labels`` (int32), ``loss_mask``
    (uint8) and ``segments`` (int32: the conversation each position belongs to within its sample,
    from 1; 0 for padding). Unpacked: one conversation a sample. Packed: conversations in order,
    a conversation that does not fit starting the next sample.
    """
    rows: list[list] = []
    used = seq_length  # forces a new row for the first example

    def new_row():
        rows.append([[], [], [], []])

    for ids, mask in examples:
        n = len(ids) - 1
        if not packing or used + n > seq_length:
            new_row()
            used = 0
        row = rows[-1]
        seg = (row[3][-1] if row[3] else 0) + 1
        row[0] += ids[:-1]
        row[1] += ids[1:]
        row[2] += mask[1:]
        row[3] += [seg] * n
        used += n
    out = {k: numpy.zeros((len(rows), seq_length), dtype) for k, dtype in
           (("tokens", numpy.int32), ("labels", numpy.int32), ("loss_mask", numpy.uint8),
            ("segments", numpy.int32))}
    out["tokens"][:] = pad_id
    out["labels"][:] = pad_id
    for r, row in enumerate(rows):
        n = len(row[0])
        for k, name in enumerate(("tokens", "labels", "loss_mask", "segments")):
            out[name][r, :n] = row[k]
    return out


def cache_key(data_cfg: Any, seq_length: int, pad_id: int, files: list[str],
              valid: list[str]) -> str:
    """What a cached chat dataset is built from: the files (path, mtime, size), the tokenizer's
    files, the template, the sequence length, the padding id and the packing fields."""
    stats = [entry for p in files + valid for entry in input_stats(p)]
    tokenizer_files = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(str(data_cfg.tokenizer), name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                tokenizer_files.append([name, hashlib.sha256(f.read()).hexdigest()])
    parts = [CHAT_FORMAT_VERSION, stats, tokenizer_files, chat_template(data_cfg),
             int(seq_length), int(pad_id), bool(data_cfg.chat_packing),
             str(data_cfg.chat_overlong), str(data_cfg.split), len(files)]
    if any(os.path.isdir(p) for p in files + valid):  # keys of .jsonl-only data unchanged
        parts += [_split_of(data_cfg, "paths"), _split_of(data_cfg, "valid_paths")]
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _split(examples: list, split: str) -> tuple[list, list]:
    """The train and validation shares of ``examples`` under ``data.split``, whole conversations
    in order as megatron splits documents (split ``i`` holds ``round(b0 * n)`` to
    ``round(b1 * n)``)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    n = float(len(examples))
    parts = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[:2]:
        parts.append([] if bounds is None else
                     examples[int(round(bounds[0] * n)):int(round(bounds[1] * n))])
    return parts[0], parts[1]


def check_chat_data(data_cfg: Any) -> dict[str, int]:
    """Everything about ``data=chat`` that can be checked before launch: the fields, the files
    (every line parsed and checked), the tokenizer's chat template (ValueError /
    FileNotFoundError: one line naming the file, the line and the fix). Returns the number of
    conversations of ``paths`` and of ``valid_paths``."""
    if str(data_cfg.chat_overlong) not in OVERLONG:
        raise ValueError(f"data.chat_overlong={data_cfg.chat_overlong!r}: valid are {OVERLONG}")
    chat_template(data_cfg)
    counts = {}
    for key in ("paths", "valid_paths"):
        counts[key] = 0
        for path in check_chat_paths(data_cfg, key):
            for _ in read_conversations(path, _split_of(data_cfg, key)):
                counts[key] += 1
    return counts


def prepare_chat(data_cfg: Any, seq_length: int, pad_id: int) -> str:
    """The cache directory of ``data_cfg``'s chat dataset, built when missing (atomically).

    Validation: ``data.valid_paths`` when given, else the last conversations by ``data.split``'s
    validation share (megatron's whole-document split, in file order).

    Raises:
        ConfigError: as :func:`check_chat_data`; a conversation the template cannot render; no
            conversation left (a refusal: one line, no traceback, in a worker too).
    """
    try:
        return _prepare_chat(data_cfg, seq_length, pad_id)
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None


def _prepare_chat(data_cfg: Any, seq_length: int, pad_id: int) -> str:
    """:func:`prepare_chat`, raising ValueError / FileNotFoundError."""
    files = check_chat_paths(data_cfg)
    valid_files = check_chat_paths(data_cfg, "valid_paths")
    out_dir = os.path.join(resolved_cache_dir(data_cfg),
                           f"chat_{cache_key(data_cfg, seq_length, pad_id, files, valid_files)}")
    if os.path.isfile(os.path.join(out_dir, "meta.json")):
        return out_dir
    check_chat_data(data_cfg)
    tok = load_template_tokenizer(data_cfg)
    started = time.perf_counter()
    counts = {"conversations": 0, "truncated": 0, "dropped": 0, "no_loss": 0}
    overlong = str(data_cfg.chat_overlong)
    train = list(progress(_conversation_samples(tok, files, seq_length, overlong, counts,
                                                _split_of(data_cfg, "paths")),
                          "tokenizing chat data", unit="conversation"))
    if valid_files:
        valid = list(_conversation_samples(tok, valid_files, seq_length, overlong, counts,
                                           _split_of(data_cfg, "valid_paths")))
    else:
        train, valid = _split(train, str(data_cfg.split))
    if not train:
        ways = ["add conversations", f"raise model.seq_length={seq_length}"]
        if overlong == "drop" and counts["dropped"]:
            ways.append("set data.chat_overlong=truncate")
        if counts["no_loss"]:  # cut before its first assistant token: truncating cannot help
            ways.append("shorten the turns before the first assistant reply")
        raise ValueError(f"no conversation of {files} is left for training ({counts}); "
                         + ", or ".join(ways))
    packing = bool(data_cfg.chat_packing)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        sizes = {}
        for name, examples in (("train", train), ("validation", valid)):
            arrays = pack(examples, seq_length, packing, pad_id)
            sizes[name] = int(arrays["tokens"].shape[0])
            numpy.savez(os.path.join(tmp_dir, f"{name}.npz"), **arrays)
        meta = {"format": CHAT_FORMAT_VERSION, "inputs": files, "validation_inputs": valid_files,
                "packing": packing, "seq_length": seq_length, "samples": sizes, **counts}
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        os.chmod(tmp_dir, 0o755)
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, "meta.json")):
                raise
        else:
            print(f"> tokenized chat data into {out_dir}: {counts['conversations']} conversations "
                  f"({counts['truncated']} truncated, {counts['dropped']} dropped as longer than "
                  f"model.seq_length={seq_length}, {counts['no_loss']} without an assistant token "
                  f"left), {sizes['train']} train / {sizes['validation']} validation samples"
                  f"{' packed' if packing else ''} in {time.perf_counter() - started:.1f} s",
                  flush=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
