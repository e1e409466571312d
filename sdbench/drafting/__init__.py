"""Drafters: what proposes tokens for a verifier (a model with a dense or sparse KV cache, prompt lookup)."""
