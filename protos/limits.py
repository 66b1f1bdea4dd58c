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
