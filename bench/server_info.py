"""What `splitserve bench online` learns from the server it benchmarks instead of from local
files: the model's name (GET /v1/models), token ids that are real tokens of its vocabulary
(POST /tokenize of a fixed text: random prompts are drawn from them, so no `--vocab-size` or
model directory is needed) and prompt texts for chat requests (POST /detokenize)."""

from __future__ import annotations

import asyncio

import httpx

# Plain prose of common words: its tokens are ordinary vocabulary entries (no special tokens,
# nothing a chat template treats specially), a few hundred of them.
SAMPLE_TEXT = (
    "The river runs past the old mill where the baker, the teacher and the fisherman meet "
    "every morning to talk about the weather, the market prices, the harvest, the new bridge "
    "and the children who walk to school along the narrow road between green fields, tall "
    "trees, stone walls and small houses with red roofs. In the evening the lights of the "
    "town shine on the water while boats return with nets full of silver fish, and people "
    "gather in the square to listen to music, share stories, drink coffee, read newspapers "
    "and plan journeys to distant cities, mountains, islands, deserts and forests."
)


class ServerInfoError(RuntimeError):
    """The server did not answer what the benchmark needs; the message says what to pass."""


async def vocabulary_sample(client: httpx.AsyncClient, base_url: str, model: str) -> list[int]:
    """Distinct token ids of SAMPLE_TEXT in the server's tokenizer, sorted."""
    try:
        resp = await client.post(f"{base_url}/tokenize", json={
            "model": model, "prompt": SAMPLE_TEXT, "add_special_tokens": False})
        resp.raise_for_status()
        ids = sorted({int(t) for t in resp.json()["tokens"]})
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
        raise ServerInfoError(f"could not tokenize with {base_url}/tokenize ({e}); pass "
                              "--vocab-size") from e
    if not ids:
        raise ServerInfoError(f"{base_url}/tokenize returned no tokens; pass --vocab-size")
    return ids


async def detokenize_all(client: httpx.AsyncClient, base_url: str, model: str,
                         prompts: list[list[int]]) -> list[str]:
    """The text of each prompt (chat requests send text), a few requests at a time."""
    sem = asyncio.Semaphore(16)

    async def one(ids: list[int]) -> str:
        async with sem:
            resp = await client.post(f"{base_url}/detokenize",
                                     json={"model": model, "tokens": ids})
        if resp.status_code != 200:
            raise ServerInfoError(f"{base_url}/detokenize: HTTP {resp.status_code}: "
                                  f"{resp.text[:200]}")
        return str(resp.json()["prompt"])

    return list(await asyncio.gather(*(one(p) for p in prompts)))
