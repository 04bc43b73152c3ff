"""The OpenAI-compatible HTTP server (`specserve serve`).

Modules: `options` (flags), `protocol` (request models), `errors` (OpenAI error bodies), `streams` (one
request's outputs; admission), `parsers` (tool calls, reasoning), `formatting` (responses and chunks),
`completions` / `chat` (the two generation endpoints), `metrics` (Prometheus), `middleware` (body size,
API key), `app` (routes), `serve` (process lifetime, signals).

Everything here except `options` needs the `server` extra (fastapi, uvicorn, prometheus-client);
the engine never imports this package.
"""
