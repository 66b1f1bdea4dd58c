"""The routes around generation: the models list and cards, the gateway's load, tokenize /
detokenize / tokenizer_info, and runtime LoRA adapter loading (gateway/lora_admin.py)."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from gateway.errors import GatewayError
from gateway.http_request import check_auth, read_json
from gateway.lora_admin import check_allowed, load_adapter, unload_adapter
from gateway.model_resolution import resolve_model
from gateway.openai_protocol import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    chat_messages,
    parse_request,
)
from gateway.state import GatewayState
from gateway.tools import template_tools_from_request


def add_admin_routes(app: FastAPI, state: GatewayState) -> None:
    """/v1/models, /load, /tokenize, /tokenizer_info, /detokenize and the LoRA adapter routes."""

    def model_cards() -> list[dict[str, Any]]:
        """The base model's card, then each LoRA adapter's the workers serve (as vLLM lists
        them: their parent is the base model)."""
        base = state.config.served_model_name
        card = {"object": "model", "created": state.created, "owned_by": "splitserve",
                "max_model_len": state.config.max_model_len}
        return [{"id": base, **card, "root": base, "parent": None},
                *({"id": name, **card, "root": name, "parent": base}
                  for name in sorted(state.lora_adapters()))]

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request, state)
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """OpenAI's retrieve (`client.models.retrieve`): one card, or a 404."""
        check_auth(request, state)
        for card in model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise GatewayError(grpc.StatusCode.NOT_FOUND, f"The model `{model_id[:200]}` does not "
                           "exist", param="model", error_code="model_not_found")

    @app.get("/load")
    async def load(request: Request) -> Response:
        """vLLM's `/load`: the requests this gateway is serving now."""
        check_auth(request, state)
        return JSONResponse({"server_load": state.limit.num_in_flight})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse_request(TokenizeRequest, await read_json(request, state))
        await resolve_model(state, req.model, load=False)
        pre = state.preprocessor
        if (req.prompt is None) == (req.messages is None):
            raise GatewayError.invalid("prompt", "send either prompt or messages")
        if req.messages is not None:
            ids = await pre.encode_chat(chat_messages(req.messages), tools=(
                template_tools_from_request(req.model_extra or {})),
                template_kwargs=req.chat_template_kwargs, chat_template=req.chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message)
        elif req.chat_template is not None:
            raise GatewayError.invalid("chat_template", "chat_template renders messages; a "
                                                        "prompt is tokenized as it is")
        else:
            ids = await pre.encode_text(req.prompt or "", "prompt", req.add_special_tokens,
                                        allow_empty=True)
        return JSONResponse({"count": len(ids), "max_model_len": state.config.max_model_len,
                             "tokens": ids})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        """vLLM's tokenizer description: what a client needs to tokenize as the server does
        (lm-eval's remote tokenizer reads it, then calls /tokenize and /detokenize)."""
        check_auth(request, state)
        tok = state.tokenizer
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast",
                             **tok.special_tokens,
                             "add_bos_token": tok.add_bos_token,
                             # the template chat requests use: the gateway's, else the model's
                             "chat_template": state.config.chat_template or tok.chat_template,
                             "model_max_length": state.config.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_request(DetokenizeRequest, await read_json(request, state))
        await resolve_model(state, req.model, load=False)
        ids = state.preprocessor.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(ids, skip_special_tokens=False)})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: the adapter loaded on every worker (or on none), then listed and routed."""
        check_auth(request, state)
        check_allowed(state.config)  # before the body: off, nothing of it matters
        req = parse_request(LoadLoRAAdapterRequest, await read_json(request, state))
        if req.load_inplace:
            raise GatewayError.invalid("load_inplace", "load_inplace is not supported: unload "
                                                       "the adapter, then load it again")
        await load_adapter(state, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: the adapter unloaded from every worker (or from none, while in use)."""
        check_auth(request, state)
        check_allowed(state.config)
        req = parse_request(UnloadLoRAAdapterRequest, await read_json(request, state))
        await unload_adapter(state, req.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
