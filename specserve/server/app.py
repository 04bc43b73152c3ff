"""The routes. Every error a client can get is an OpenAI error body, FastAPI's own 404/405 included; 429 and
503 carry Retry-After. /openapi.json and /docs describe the API with the models of `protocol`."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Literal, Optional

from fastapi import FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from .. import __version__
from ..engine.outputs import RequestError
from ..sampling_params import SamplingParams
from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError, retry_after, server_error
from .generate import abort_request, generate
from .lora_api import add_lora_routes
from .middleware import ApiKey, BodyLimit
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .protocol_responses import ResponsesRequest
from .responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    ResponseDeleted,
    ResponseObject,
    ResponseStreamEvent,
    TokenizeResponse,
    Version,
)
from .responses_api import create_response, input_items_page, stored_response
from .responses_background import cancel as cancel_background
from .state import ServerState
from .tokenize import detokenize, tokenize
from .weights_api import add_weight_routes

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/health_generate", "/ping", "/metrics", "/version", "/openapi.json", "/docs")  # no key
HEALTH_GENERATE_TIMEOUT = 20.0  # seconds SGLang's /health_generate waits for its token
# the routes read them from the raw request
REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest)
CHUNK_MODELS = (CompletionChunk, ChatCompletionChunk, ResponseStreamEvent)  # the JSON of streamed events


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own errors (404, 405) as OpenAI error bodies, with their headers (405's Allow)."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind))
    response.headers.update(exc.headers or {})
    return response


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return _error_response(server_error(f"internal error: {exc!r}"))


def _errors(*statuses: int) -> dict:
    """OpenAPI `responses` entries for these error statuses."""
    return {status: {"model": ErrorResponse} for status in statuses}


def _ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _sse_event(chunk_model, done: bool = True) -> dict:
    """The schema of one server-sent event (OpenAPI 3.1: a text/event-stream schema describes each event);
    done: the stream ends with `data: [DONE]`."""
    chunk = {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [_ref(chunk_model), _ref(ErrorResponse)]},
             "description": f"a {chunk_model.__name__} as JSON (an ErrorResponse if the engine fails during the "
                            "stream)"}
    data = {"anyOf": [chunk, {"const": "[DONE]", "description": "the last event"}]} if done else chunk
    return {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}


def _generation_docs(request_model, response_model, chunk_model, done: bool = True) -> dict:
    """Route arguments that document a generation endpoint: its JSON body, its JSON or SSE answer, errors."""
    body = {"content": {"application/json": {"schema": _ref(request_model)}}, "required": True}
    events = "chunks, then `data: [DONE]`" if done else "typed events, the last response.completed (or incomplete)"
    sse = {"description": f"the body, or with stream=true server-sent events: {events}",
           "content": {"text/event-stream": {"schema": _sse_event(chunk_model, done)}}}
    return dict(response_model=response_model, openapi_extra={"requestBody": body},
                responses={200: sse, **_errors(400, 401, 404, 413, 429, 500, 503)})


def _tokenizer_docs(request_model, response_model) -> dict:
    """Route arguments that document /tokenize or /detokenize."""
    body = {"content": {"application/json": {"schema": _ref(request_model)}}, "required": True}
    return dict(response_model=response_model, openapi_extra={"requestBody": body},
                responses=_errors(400, 401, 404, 413, 500, 503))


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models of the generation routes (it cannot see them: the routes
    read the raw request) and their stream chunks, less the 422 FastAPI documents but this app never sends."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        models = [(m, "validation") for m in REQUEST_MODELS] + [(m, "serialization") for m in CHUNK_MODELS]
        _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs["$defs"])
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """The FastAPI app over `state`, with the API key and body limit in front."""
    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan, redoc_url=None,
                  swagger_ui_oauth2_redirect_url=None,
                  description="OpenAI-compatible completions, chat completions and responses, with vLLM's sampling "
                              "extras.")
    app.openapi = lambda: _openapi(app)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(BodyLimit, max_bytes=state.options.max_body_bytes)
    app.add_middleware(ApiKey, api_key=state.options.api_key, open_paths=OPEN_PATHS)
    if state.options.origins:  # outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=state.options.origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.state.server = state
    created = int(time.time())

    def model_card(name: str) -> dict:
        """The served model's card, or an adapter's (with its folder and the model it adapts)."""
        config = state.serving_engine().engine.config.model
        card = {"id": name, "object": "model", "created": created, "owned_by": "specserve",
                "max_model_len": config.max_model_len}
        if name != state.model_name:
            card.update(root=state.adapters[name].folder, parent=state.model_name)
        return card

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    @app.get("/ping", response_model=Health, responses={503: {"model": Health}})  # vLLM's, for SageMaker
    @app.post("/ping", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status, headers=retry_after(status))

    @app.get("/health_generate", response_model=Health, responses={503: {"model": Health}})
    async def health_generate() -> JSONResponse:
        """SGLang's deeper probe: /health's answer, once one token has been generated end to end (input id 0,
        greedy) within HEALTH_GENERATE_TIMEOUT seconds; 503 otherwise."""
        status, body = state.health()
        if status == 200:
            try:
                await asyncio.wait_for(_one_token(state.serving_engine()), HEALTH_GENERATE_TIMEOUT)
            except Exception as e:  # noqa: BLE001 (any failure is an unhealthy answer)
                status, body = 503, {"status": "failed", "error": f"no token generated: {e!r}"}
        return JSONResponse(body, status_code=status, headers=retry_after(status))

    @app.get("/version", response_model=Version)
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info", response_model=dict, responses=_errors(401))
    @app.get("/get_server_info", response_model=dict, responses=_errors(401))  # SGLang's older path
    async def server_info() -> JSONResponse:
        return JSONResponse(state.info())

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401, 500, 503))
    async def models() -> JSONResponse:
        state.serving_engine()
        return JSONResponse({"object": "list", "data": [model_card(m) for m in [state.model_name, *state.adapters]]})

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(401, 404, 500, 503))
    async def model(model_id: str) -> JSONResponse:
        state.check_model(model_id)
        return JSONResponse(model_card(model_id))

    @app.post("/v1/completions", **_generation_docs(CompletionRequest, CompletionResponse, CompletionChunk))
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions", **_generation_docs(ChatCompletionRequest, ChatCompletionResponse,
                                                                  ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    @app.post("/v1/responses", **_generation_docs(ResponsesRequest, ResponseObject, ResponseStreamEvent, done=False))
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (server/responses_api.py; background: server/responses_background.py)."""
        return await create_response(request, state)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_errors(401, 404))
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored_response(state, response_id).body)

    @app.get("/v1/responses/{response_id}/input_items", response_model=dict, responses=_errors(401, 404))
    async def get_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                              order: Literal["asc", "desc"] = "desc", after: Optional[str] = None,
                              before: Optional[str] = None) -> JSONResponse:
        """OpenAI's list of a stored response's input items (newest first by default)."""
        return JSONResponse(input_items_page(stored_response(state, response_id), limit, order, after, before))

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=_errors(400, 401))
    async def cancel_response(response_id: str) -> JSONResponse:
        """OpenAI's: end a background response in progress (server/responses_background.py)."""
        return await cancel_background(state, response_id)

    @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=_errors(401, 404))
    async def delete_response(response_id: str) -> JSONResponse:
        stored_response(state, response_id)
        state.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/reset_prefix_cache", response_class=PlainTextResponse, responses=_errors(401, 409, 500, 503))
    @app.post("/flush_cache", response_class=PlainTextResponse, responses=_errors(401, 409, 500, 503))
    async def reset_prefix_cache() -> PlainTextResponse:
        """Forget every cached prefix (vLLM's /reset_prefix_cache, SGLang's /flush_cache), as between benchmark
        runs; 409 while requests run."""
        engine = state.serving_engine()
        try:
            await engine.call(engine.engine.reset_prefix_cache)
        except RequestError as e:
            raise APIError(409, str(e), "conflict_error", code="requests_running") from None
        return PlainTextResponse("Success: the prefix cache is empty.")

    if state.options.allow_runtime_lora_updating:
        add_lora_routes(app, state)
    add_weight_routes(app, state)

    @app.post("/generate", responses=_errors(400, 401, 413, 429, 500, 503))
    async def generate_route(request: Request) -> Response:
        """SGLang's native generation API (server/generate.py)."""
        return await generate(request, state)

    @app.post("/abort_request", responses=_errors(400, 401, 503))
    async def abort_request_route(request: Request) -> Response:
        """SGLang's: end a request (or all) now; each answers its output so far, finish reason "abort"."""
        return await abort_request(request, state)

    @app.post("/tokenize", **_tokenizer_docs(TokenizeRequest, TokenizeResponse))
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(request, state)

    @app.post("/detokenize", **_tokenizer_docs(DetokenizeRequest, DetokenizeResponse))
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(request, state)

    return app


async def _one_token(engine) -> None:
    async for _ in engine.generate([0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                   f"health-{uuid.uuid4().hex}"):
        pass
