"""The MoE family: Mixtral / Qwen3-MoE-style decoders, megatron's ``GPTModel`` with MoE layers."""
