"""The GPT family: dense GPT-2 and Llama-style decoders built as megatron's ``GPTModel``."""
