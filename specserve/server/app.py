"""The routes. Every error a client can get is an OpenAI error body, FastAPI's own 404/405 included."""
from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError, server_error
from .middleware import ApiKey, BodyLimit
from .state import ServerState

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # no API key needed


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return _error_response(server_error(f"internal error: {exc!r}"))


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """The FastAPI app over `state`, with the API key and body limit in front."""
    app = FastAPI(title="specserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(BodyLimit, max_bytes=state.options.max_body_bytes)
    app.add_middleware(ApiKey, api_key=state.options.api_key, open_paths=OPEN_PATHS)
    app.state.server = state
    created = int(time.time())

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(state.info())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        engine = state.serving_engine()
        card = {"id": state.model_name, "object": "model", "created": created, "owned_by": "specserve",
                "max_model_len": engine.engine.config.model.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    return app
