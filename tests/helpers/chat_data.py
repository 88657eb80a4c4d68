"""The chat tests' data: ``tests/data/chat.jsonl`` (38 short conversations written for the tests,
multi-turn ones, a system turn in some, two in the prompt/completion form) and a Hugging Face
tokenizer directory with a ChatML chat template, trained here as tests/test_hf_tokenizer.py's.

The tokenizer's template is plain ChatML (:data:`CHATML_PLAIN`), so ``recipes.data.chat``
derives the loss mask by rendering prefixes; :data:`CHATML`, the same with each assistant turn
marked ``{% generation %}``, gives transformers' ``return_assistant_tokens_mask`` as an
independent reference.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "chat.jsonl"
VOCAB = 400
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML without markers: what tests/test_chat_data.py's derived mask is checked on.
CHATML_PLAIN = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's quirk: an empty think block in the last assistant turn only, so a prefix renders an
# earlier turn differently from the whole; the markers place the turns anyway.
THINK_LAST = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def conversations() -> list[list[dict]]:
    """The fixture's conversations as message lists (prompt/completion as two turns)."""
    out = []
    for line in FIXTURE.read_text().splitlines():
        rec = json.loads(line)
        out.append(rec.get("messages") or [{"role": "user", "content": rec["prompt"]},
                                           {"role": "assistant", "content": rec["completion"]}])
    return out


_TRAINED: list[str] = []  # the tokenizer.json text, trained once per process


def write_chat_tokenizer(out: Path, template: str | None = CHATML_PLAIN) -> Path:
    """A byte-level BPE of :data:`VOCAB` tokens (the ChatML specials first) trained on the pydoc
    topics and the fixture, saved with ``tokenizer_config.json`` holding ``template`` (None:
    no chat template). Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if not _TRAINED:
        _TRAINED.append(_train())
    (out / "tokenizer.json").write_text(_TRAINED[0])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def _train() -> str:
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [topics[k] for k in sorted(topics)] + [FIXTURE.read_text()]
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()
