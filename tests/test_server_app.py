"""The app in-process, over a real AsyncEngine: what clients get while the model loads, and once the
engine has stopped (never a hang: a request in flight ends with a 500)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from specserve.assets import make_tiny_checkpoint  # noqa: E402
from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.async_engine import AsyncEngine  # noqa: E402
from specserve.server.app import build_app  # noqa: E402
from specserve.server.options import ServerOptions  # noqa: E402
from specserve.server.serve import warm_up, watch_engine  # noqa: E402
from specserve.server.state import Phase, ServerState  # noqa: E402


async def call(app, method: str, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, **kw)


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_while_starting_everything_but_metrics_is_503():
    app = build_app(ServerState(ServerOptions(), "m"))

    async def main():
        return [await call(app, "GET", "/health"), await call(app, "GET", "/v1/models"),
                await call(app, "POST", "/v1/completions", json={"prompt": "x"}),
                await call(app, "GET", "/metrics"), await call(app, "GET", "/health_generate")]

    health, models, completion, metrics, deep = asyncio.run(main())
    assert health.status_code == 503 and health.json() == {"status": "starting"}
    assert (deep.status_code, deep.json()) == (503, {"status": "starting"})
    assert assert_openai_error(models, 503)["type"] == "service_unavailable_error"
    assert "loading" in assert_openai_error(completion, 503)["message"]
    assert metrics.status_code == 200


def test_a_stopped_engine_fails_requests_with_500(tmp_path):
    make_tiny_checkpoint(str(tmp_path / "tiny"))
    engine = AsyncEngine(EngineConfig.from_options(model=str(tmp_path / "tiny")))
    state = ServerState(ServerOptions(), "m")
    state.attach(engine)
    app = build_app(state)

    async def main():
        await warm_up(engine)
        state.phase = Phase.SERVING
        watcher = asyncio.create_task(watch_engine(state, interval=0.05))
        healthy = await call(app, "GET", "/health")
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
        in_flight = asyncio.create_task(call(app, "POST", "/v1/completions", json=body))
        while not len(state.requests):
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown)  # the engine thread stops under a running request
        failed = await asyncio.wait_for(in_flight, 10)
        after = [await call(app, "GET", "/health"), await call(app, "POST", "/v1/completions", json=body),
                 await call(app, "GET", "/health_generate")]
        watcher.cancel()
        return healthy, failed, after

    try:
        healthy, failed, (health, refused, deep) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert healthy.status_code == 200
    assert assert_openai_error(failed, 500)["type"] == "server_error"
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "engine has failed" in assert_openai_error(refused, 500)["message"]
    assert deep.status_code == 503 and deep.json()["status"] == "failed"


def test_controller_explanation_as_metrics():
    from specserve.server.metrics import EngineCollector

    explained = {"policy": "adaptive", "acceptance_per_position": [0.8], "buckets": {
        8: {"k": 2, "exploration_share": 0.04, "predicted_goodput": {"plain": 800.0, "chain-2": 1500.0}}}}
    families = {f.name: f for f in EngineCollector(lambda: None, "m")._controller(explained)}
    samples = {(f, tuple(sorted(s.labels.items()))): s.value for f in families for s in families[f].samples}
    assert samples[("specserve:spec_decode_chosen_k", (("bucket", "8"), ("model_name", "m")))] == 2
    assert samples[("specserve:spec_decode_exploration_ratio", (("bucket", "8"), ("model_name", "m")))] == 0.04
    key = ("specserve:spec_decode_predicted_goodput", (("bucket", "8"), ("model_name", "m"), ("shape", "chain-2")))
    assert samples[key] == 1500.0
