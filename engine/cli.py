"""`splitserve generate`: run the engine in this process on one prompt and stream the answer."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.cli_args import add_engine_args, engine_config_from_args
from engine_api.sampling_params import SamplingParams, SamplingParamsError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve generate",
                                description="Generate a completion in-process.")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed)
    except SamplingParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM.from_config(engine_config_from_args(args))
    prompt: str | dict[str, list[int]] = args.prompt
    if args.chat:
        tok = llm.get_tokenizer()
        if tok is None:
            print("error: --chat needs a model with a tokenizer", file=sys.stderr)
            return 2
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    for step in llm.stream(prompt, params):
        sys.stdout.write(step.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
