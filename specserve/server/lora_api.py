"""vLLM's run-time LoRA routes (with --allow-runtime-lora-updating): POST /v1/load_lora_adapter
`{"lora_name", "lora_path"}` serves a PEFT folder on this machine under a new name; POST /v1/unload_lora_adapter
`{"lora_name"}` stops serving one that no unfinished request uses. Both answer in plain text, as vLLM does; the
change happens in the engine thread between two steps, on every tensor-parallel rank."""
from __future__ import annotations

import os
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..engine.outputs import RequestError
from ..models.lora import LoRAError
from .errors import APIError, bad_request
from .generation import read_body
from .protocol import NonEmpty, _Strict
from .state import ServerState


class LoadLoRARequest(_Strict):
    lora_name: NonEmpty
    lora_path: NonEmpty


class UnloadLoRARequest(_Strict):
    lora_name: NonEmpty
    lora_int_id: Optional[int] = None  # vLLM's, accepted: the name says which


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        engine = state.serving_engine()
        req = await read_body(request, LoadLoRARequest)
        if req.lora_name == state.model_name:
            raise bad_request(f"{req.lora_name!r} is the served model's name", "lora_name")
        if not os.path.isdir(req.lora_path):
            raise bad_request(f"lora_path {req.lora_path!r} is not a folder on the server", "lora_path")
        try:
            await engine.call(engine.engine.load_lora, req.lora_name, req.lora_path)
        except RequestError as e:
            raise bad_request(str(e), "lora_name") from None
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        engine = state.serving_engine()
        req = await read_body(request, UnloadLoRARequest)
        if req.lora_name not in state.adapters:
            raise APIError(404, f"the LoRA adapter {req.lora_name!r} cannot be found", "not_found_error",
                           "lora_name")
        try:
            await engine.call(engine.engine.unload_lora, req.lora_name)
        except RequestError as e:
            raise bad_request(str(e), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
