"""The OpenAI-compatible HTTP server (`specserve serve`).

Modules: `options` (flags), `protocol` (request and response models, the OpenAPI schema), `errors`
(OpenAI error bodies), `streams` (one request's outputs; admission), `parsers` (tool calls, reasoning),
`formatting` (responses and chunks), `completions` / `chat` (the two generation endpoints), `metrics`
(Prometheus), `middleware` (body size, access log, API key), `app` (routes), `serve` (process lifetime,
signals).

Everything here except `options` needs the `server` extra (fastapi, uvicorn, prometheus-client);
the engine never imports this package.
"""
