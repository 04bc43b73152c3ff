"""POST /tokenize and /detokenize, as vLLM serves them: the served model's tokenizer, so that a client counts
and builds prompts in the tokens the engine sees (a prompt as /v1/completions tokenizes it; messages as
/v1/chat/completions renders them, so the count is that request's usage.prompt_tokens)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from .chat import render_prompt
from .errors import bad_request
from .generation import parse_request
from .protocol import DetokenizeRequest, TokenizeRequest
from .state import ServerState


async def tokenize(request: Request, state: ServerState) -> JSONResponse:
    engine, req = await parse_request(request, state, TokenizeRequest)
    tokenizer = _tokenizer(engine)
    if req.messages is not None:
        ids = render_prompt(tokenizer, req)
        if req.add_special_tokens:
            ids = tokenizer.build_inputs_with_special_tokens(ids)
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    body = {"count": len(ids), "max_model_len": engine.engine.config.model.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(body)


async def detokenize(request: Request, state: ServerState) -> JSONResponse:
    engine, req = await parse_request(request, state, DetokenizeRequest)
    tokenizer = _tokenizer(engine)
    vocab = engine.engine.arch.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})", "tokens")
    return JSONResponse({"prompt": tokenizer.decode(req.tokens)})


def _tokenizer(engine):
    if engine.tokenizer is None:
        raise bad_request("this model folder has no tokenizer")
    return engine.tokenizer
