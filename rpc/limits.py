"""Message size limits shared by the services and their clients (torch-free: the gateway
imports it)."""

from __future__ import annotations

# A worker's gRPC messages either way: prompts of up to ~16M token ids; KV fragments are far
# smaller; a scored prompt's logprobs stay under MAX_PROMPT_LOGPROBS_BYTES.
MAX_MESSAGE_BYTES = 64 << 20
# The prompt logprobs one response may carry, leaving the rest of MAX_MESSAGE_BYTES to the
# message's other fields.
MAX_PROMPT_LOGPROBS_BYTES = 48 << 20


def message_size_options() -> list[tuple[str, int]]:
    """gRPC channel / server options for MAX_MESSAGE_BYTES both ways (the default receive
    limit is 4 MB)."""
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def prompt_logprobs_bytes(num_tokens: int, num_top: int) -> int:
    """An upper bound of the wire size of a prompt's logprobs (`PromptLogprobs`, packed: per
    scored token an id and a rank of at most 5 bytes each and a 4-byte logprob, per top entry
    an id and a logprob)."""
    return max(0, num_tokens - 1) * (14 + 9 * num_top)


# A runtime LoRA adapter load's name and directory (LoadLoRAAdapterRequest): bounds the gateway
# and the workers both check before anything reads a file. The engine's own name rule is
# stricter (engine/config/lora.py); a path is bounded as Linux's PATH_MAX bounds it.
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


def lora_field_problem(field: str, value: str, max_chars: int) -> str | None:
    """Why `value` cannot be a LoRA adapter's name or directory (`field` names it in the
    message), or None when it can."""
    if not value:
        return f"{field} is required"
    if len(value) > max_chars:
        return f"{field} is {len(value)} characters; the limit is {max_chars}"
    if "\x00" in value:
        return f"{field} must not contain NUL characters"
    return None
