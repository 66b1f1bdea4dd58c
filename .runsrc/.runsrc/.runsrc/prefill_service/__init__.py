"""Prefill role: computes a prompt's KV, samples the first token, holds the KV under a lease."""
