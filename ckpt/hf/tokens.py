"""End-of-document tokens of Hugging Face tokenizers (one owner: the data pipeline and the
export both look the end of document up here)."""

from __future__ import annotations

# Looked up in a tokenizer.json, in this order, when data.eod_id is null.
EOD_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>", "<eod>")


def eod_of_tokenizer(file) -> int | None:
    """The id of the first of :data:`EOD_TOKENS` the ``tokenizer.json`` ``file`` knows, or None."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    for token in EOD_TOKENS:
        if tok.token_to_id(token) is not None:
            return int(tok.token_to_id(token))
    return None
