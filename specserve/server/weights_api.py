"""SGLang's weight routes, for reinforcement-learning loops that serve each new policy without a restart:
POST /update_weights_from_disk `{"model_path", "load_format"}` loads a checkpoint of the served architecture and
shapes into the running model (`LLMEngine.update_weights`: in place, on every rank, between two steps; the prefix
cache is emptied) and answers SGLang's `{"success", "message", "num_paused_requests"}`: 200, or 409 while
requests run (call it between rollouts), 400 for a folder that does not fit (the served weights stay). GET
/get_model_info says which weights are served."""
from __future__ import annotations

import os
from typing import Literal, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ..engine.outputs import EngineBusy, RequestError
from ..models import WeightError
from .errors import bad_request
from .generation import read_body
from .protocol import NonEmpty
from .state import ServerState


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's other fields (flush_cache, weight_version, ...)

    model_path: NonEmpty
    load_format: Optional[Literal["auto", "safetensors", "dummy"]] = None
    abort_all_requests: Literal[False] = False  # true (abort what runs, then load) is not served: 400


def _answer(status: int, success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, "num_paused_requests": 0}, status_code=status)


def add_weight_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        engine = state.serving_engine()
        req = await read_body(request, UpdateWeightsRequest)
        load_format = "dummy" if req.load_format == "dummy" else "safetensors"
        if load_format != "dummy" and not os.path.isdir(req.model_path):
            raise bad_request(f"model_path {req.model_path!r} is not a folder on the server", "model_path")
        try:
            await engine.call(engine.engine.update_weights, req.model_path, load_format)
        except EngineBusy as e:
            return _answer(409, False, str(e))
        except (RequestError, WeightError) as e:
            return _answer(400, False, str(e))
        return _answer(200, True, f"Succeeded to update model weights from {req.model_path}.")

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        core = state.serving_engine().engine
        return JSONResponse({"model_path": core.weights[0], "tokenizer_path": core.config.model.tokenizer,
                             "is_generation": True})
