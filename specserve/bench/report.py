"""Level statistics with vLLM's key names (`vllm bench serve`), the terminal table, and the JSON file.

Per level: throughputs over the level's wall time; TTFT, TPOT (= (latency - ttft) / (output tokens - 1)),
ITL (gaps between content chunks) and end-to-end latency in ms as mean, median and the percentiles asked (p99 by
default); completed and failed counts; with SLOs, `request_goodput`: the completed requests a second that met
every one (TPOT 0 for a one-token output, as vLLM counts it). Only completed requests count towards tokens and
latencies.
"""
from __future__ import annotations

import json
from typing import Iterable, Optional

import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from .client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """mean_/median_/p{N}_{name}_ms from values in seconds (0 when there are none, as vLLM reports)."""
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    out.update((f"p{p:g}_{name}_ms", float(np.percentile(ms, p))) for p in percentiles)
    return out


def _good(r: RequestResult, slos: tuple[tuple[str, float], ...]) -> bool:
    """Did a completed request meet every (metric, ms) SLO?"""
    seconds = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.latency}
    return all(seconds[name] is not None and seconds[name] * 1000 <= ms for name, ms in slos)


def _tpot(r: RequestResult) -> Optional[float]:
    if r.output_tokens > 1 and r.ttft is not None:
        return (r.latency - r.ttft) / (r.output_tokens - 1)
    return None


def summarize_level(results: list[RequestResult], duration: float, concurrency: int,
                    request_rate: Optional[float], accept_length: Optional[float],
                    percentiles: tuple[float, ...] = (99.0,), goodput: tuple[tuple[str, float], ...] = ()) -> dict:
    """One level's JSON: the statistics, then the per-request records under "requests"."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    level = {
        "concurrency": concurrency,
        "request_rate": request_rate if request_rate is not None else "inf",
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output / duration if duration > 0 else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration > 0 else 0.0,
        "request_goodput": (sum(_good(r, goodput) for r in done) / duration if duration > 0 else 0.0)
        if goodput else None,
    }
    level.update(_stats("ttft", [r.ttft for r in done if r.ttft is not None], percentiles))
    level.update(_stats("tpot", [t for t in map(_tpot, done) if t is not None], percentiles))
    level.update(_stats("itl", [gap for r in done for gap in r.itl], percentiles))
    level.update(_stats("e2el", [r.latency for r in done], percentiles))
    level["mean_accept_length"] = accept_length
    level["errors"] = sorted({r.error for r in results if r.error})[:10]  # distinct, a few
    level["requests"] = [r.record() for r in results]
    return level


def _num(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def level_table(levels: Iterable[dict], title: str = "") -> Table:
    """The terminal table: one row a level; latencies in ms, means unless marked p99."""
    levels = list(levels)
    good = any(lv.get("request_goodput") is not None for lv in levels)
    table = Table(title=title or None, caption="latencies in ms")
    for column in ("C", "ok", "fail", "out tok/s", "total tok/s", "req/s", *(("good req/s",) if good else ()),
                   "TTFT", "TTFT p99", "TPOT", "ITL", "E2E", "E2E p99", "accept"):
        table.add_column(column, justify="right")
    for lv in levels:
        table.add_row(str(lv["concurrency"]), str(lv["completed"]), str(lv["failed"]),
                      _num(lv["output_throughput"]), _num(lv["total_token_throughput"]),
                      _num(lv["request_throughput"], 2), *((_num(lv["request_goodput"], 2),) if good else ()),
                      _num(lv["mean_ttft_ms"]), _num(lv.get("p99_ttft_ms")), _num(lv["mean_tpot_ms"]),
                      _num(lv["mean_itl_ms"]), _num(lv["mean_e2el_ms"]), _num(lv.get("p99_e2el_ms")),
                      _num(lv["mean_accept_length"], 2))
    return table


def print_table(table: Table, console: Console) -> None:
    """Print `table` whole: a console narrower than the table (80 columns when the output is not a terminal)
    is widened for it, so no cell is cut to "…" (a narrower terminal wraps the long lines instead)."""
    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    width = console.width
    console.width = max(width, needed)
    try:
        console.print(table)
    finally:
        console.width = width


def print_levels(levels: list[dict], title: str = "", console: Optional[Console] = None) -> None:
    console = console or Console()
    print_table(level_table(levels, title), console)
    for lv in levels:
        for error in lv["errors"]:
            console.print(f"[red]concurrency {lv['concurrency']}: {error}[/red]")


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
