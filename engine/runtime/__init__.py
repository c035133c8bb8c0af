"""Decode runtime: the engine the app calls, the model, KV cache, RoPE, sampling, tokenizer and chat formats, input validation, remote models."""
