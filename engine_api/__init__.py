"""The engine's torch-free API: what a request says and how text becomes tokens.

Sampling, pooling and beam-search parameters, LoRA names, block hashing (the name a KV block has
everywhere), the tokenizer, detokenizer and chat templates, the model's generation defaults.
The gateway validates requests and routes with these without importing torch; the engine
builds on them.
"""
