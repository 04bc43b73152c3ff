"""`specserve compare`: the same sweep against one server per configuration, side by side.

Each configuration is a set of `specserve serve` flags. Its server starts on a free port in its own process
group, the sweep runs once /health is 200, and the server is stopped (SIGTERM, then SIGKILL of the group)
however the sweep ends. A configuration whose server cannot start is reported and the others still run.
The servers' logs go to a temporary folder, removed at the end unless a server failed.

With `rounds` > 1 the configurations run side by side instead: every server is started up front (one after
another, so that no start-up measurement shares the CPU with another), then each level runs on each server
in turn, round after round (`runner.run_interleaved`), and the ratios are the median of the rounds' ratios.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import statistics
import tempfile
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..assets import default_draft_path
from .client import BenchError
from .options import SweepOptions
from .report import print_levels
from .runner import run_interleaved, run_sweep
from .server_process import ServerProcess, ServerStartError


@dataclass(frozen=True)
class Configuration:
    name: str
    flags: str  # `specserve serve` flags, shell-quoted

    @property
    def args(self) -> list[str]:
        return shlex.split(self.flags)

    @classmethod
    def parse(cls, text: str) -> "Configuration":
        """NAME=FLAGS, e.g. "chain=--speculative-algorithm EAGLE3 --speculative-num-steps 3"."""
        name, sep, flags = text.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"a configuration is NAME='FLAGS', got {text!r}")
        shlex.split(flags)  # unbalanced quotes fail here, before any server starts
        return cls(name.strip(), flags.strip())


# What `specserve compare` runs when no --config is given: edit here to change the default comparison.
DEFAULT_CONFIGURATIONS = (
    Configuration("plain", "--speculative-algorithm none"),
    Configuration("chain", "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-policy always"),
    Configuration("adaptive", "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-policy adaptive"),
)
# The sweep those defaults use, sized for a small CPU.
SMALL_CPU_SWEEP = SweepOptions(concurrency=(1, 2, 5, 10), requests_per_level=10, max_tokens=64, warmup=2)


def skip_reason(config: Configuration, model: Optional[str]) -> Optional[str]:
    """Why `config` cannot run here: speculation on the default model without the shipped drafter."""
    def value(flag: str) -> Optional[str]:
        args = config.args
        for i, a in enumerate(args):
            if a == flag:
                return args[i + 1] if i + 1 < len(args) else ""
            if a.startswith(flag + "="):
                return a[len(flag) + 1:]
        return None

    algorithm = value("--speculative-algorithm")
    uses_default_draft = (model is None and algorithm not in (None, "none")
                          and value("--speculative-draft-model-path") is None)
    if uses_default_draft and default_draft_path() is None:
        return ("the shipped default EAGLE-3 drafter (specserve/assets/default/eagle3) is missing: "
                "pass --speculative-draft-model-path in the configuration")
    return None


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt, like Ctrl-C, so that cleanup code runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _new_record(config: Configuration, model: Optional[str], console: Console) -> dict:
    """The configuration's record before its server starts (status skipped, with the reason, if it cannot)."""
    record = {"name": config.name, "flags": config.flags, "status": "skipped", "error": skip_reason(config, model),
              "pid": None, "log": None, "result": None}
    if record["error"]:
        console.print(Text(f"{config.name}: skipped: {record['error']}", style="yellow"))
    return record


def _start_server(config: Configuration, record: dict, model: Optional[str], log_dir: str,
                  console: Console) -> ServerProcess:
    args = (["--model", model] if model else []) + config.args
    log_path = os.path.join(log_dir, f"{_file_name(config.name)}.log")
    server = ServerProcess(args, log_path)
    record.update(pid=server.pid, log=log_path)
    console.print(f"{config.name}: started server pid {server.pid} on {server.url} (log: {log_path})",
                  soft_wrap=True)  # paths whole, not folded at the console's width
    return server


def _failed(record: dict, error: Exception, console: Console) -> None:
    record.update(status="failed", error=str(error))
    console.print(Text(f"{record['name']}: {error}", style="red"), soft_wrap=True)


def run_configuration(config: Configuration, options: SweepOptions, model: Optional[str], log_dir: str,
                      startup_timeout: float, console: Console) -> dict:
    """Start the configuration's server, run the sweep, stop the server; the configuration's record:
    name, flags, status (ok / skipped / failed), error, server pid and log, and the sweep's result."""
    record = _new_record(config, model, console)
    if record["error"]:
        return record
    server = _start_server(config, record, model, log_dir, console)
    try:
        server.wait_ready(startup_timeout)
        record["result"] = asyncio.run(run_sweep(server.url, options, console, title=config.name))
        record.update(status="ok", error=None)
    except (ServerStartError, BenchError) as e:
        _failed(record, e, console)
    finally:
        server.stop()
        console.print(f"{config.name}: server pid {server.pid} stopped")
    return record


def run_side_by_side(configs: list[Configuration], options: SweepOptions, model: Optional[str], log_dir: str,
                     startup_timeout: float, console: Console) -> list[dict]:
    """Start every configuration's server, one after another, each once the one before is ready; run the
    sweep on all of them level by level (`run_interleaved`); stop them all however it ends. The records as
    `run_configuration`'s."""
    records = [_new_record(config, model, console) for config in configs]
    servers: list[ServerProcess] = []
    ready: list[tuple[dict, ServerProcess]] = []
    try:
        for config, record in zip(configs, records):
            if record["error"]:
                continue
            server = _start_server(config, record, model, log_dir, console)
            servers.append(server)
            try:
                server.wait_ready(startup_timeout)
                ready.append((record, server))
            except ServerStartError as e:
                _failed(record, e, console)
                server.stop()
        if ready:
            results = asyncio.run(run_interleaved([(r["name"], s.url) for r, s in ready], options, console))
            for (record, _), result in zip(ready, results):
                if isinstance(result, BenchError):
                    _failed(record, result, console)
                else:
                    record.update(status="ok", error=None, result=result)
    finally:
        for server in servers:
            server.stop()
            console.print(f"server pid {server.pid} stopped")
    return records


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "config"


def run_compare(configs: list[Configuration], options: SweepOptions, model: Optional[str] = None,
                log_dir: Optional[str] = None, startup_timeout: float = 300,
                console: Optional[Console] = None) -> dict:
    """Run every configuration in turn, or with `options.rounds` > 1 side by side (SIGTERM and Ctrl-C stop the
    running servers before they end this). The result: {"options", "model", "configurations": [record per
    configuration]}. Without `log_dir` the logs go to a temporary folder, removed at the end unless a server
    failed (its path is printed then)."""
    console = console or Console(stderr=True)
    temporary = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix="specserve-compare-")
    os.makedirs(log_dir, exist_ok=True)
    records = []
    try:
        with sigterm_as_interrupt():
            if options.rounds > 1:
                records += run_side_by_side(configs, options, model, log_dir, startup_timeout, console)
                for record in records:
                    if record["result"]:
                        print_levels(record["result"]["levels"], title=f"{record['name']} (median of "
                                     f"{options.rounds} rounds)", console=console)
            else:
                for config in configs:
                    records.append(run_configuration(config, options, model, log_dir, startup_timeout, console))
                    if records[-1]["result"]:
                        print_levels(records[-1]["result"]["levels"], title=config.name, console=console)
    finally:
        if temporary:
            _remove_logs_unless_failed(log_dir, records, console)
    return {"options": options.record(), "model": model, "configurations": records}


def _remove_logs_unless_failed(log_dir: str, records: list[dict], console: Console) -> None:
    if any(r["status"] == "failed" for r in records):
        console.print(f"the servers' logs are kept in {log_dir}", markup=False, soft_wrap=True)
        return
    shutil.rmtree(log_dir, ignore_errors=True)
    for record in records:
        record["log"] = None


# ---- the side-by-side view ----------------------------------------------------------------------------
def throughput_rows(comparison: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: output tokens/s per concurrency level for each configuration that ran, then the
    ratio of each later configuration to the first (levels run in rounds: the median of the rounds'
    ratios, each round's pair measured side by side)."""
    ran = [c for c in comparison["configurations"] if c["result"]]
    per_config = [{lv["concurrency"]: lv for lv in c["result"]["levels"]} for c in ran]
    levels = sorted({level for table in per_config for level in table})
    header = ["concurrency"] + [f"{c['name']} tok/s" for c in ran]
    header += [f"{c['name']} / {ran[0]['name']}" for c in ran[1:]]
    rows = []
    for level in levels:
        found = [table.get(level) for table in per_config]
        values = [lv["output_throughput"] if lv else None for lv in found]
        ratios = [level_ratio(lv, found[0]) for lv in found[1:]]
        rows.append([str(level)] + [_fmt(v, 1) for v in values] + [_fmt(r, 2) for r in ratios])
    return header, rows


def level_ratio(level: Optional[dict], base: Optional[dict]) -> Optional[float]:
    """`level`'s output throughput over `base`'s: the median of the per-round ratios when both ran the same
    number of rounds, else the ratio of their (median) throughputs."""
    if level is None or base is None:
        return None
    rounds, base_rounds = level.get("rounds"), base.get("rounds")
    if rounds and base_rounds and len(rounds) == len(base_rounds):
        ratios = [_ratio(a["output_throughput"], b["output_throughput"]) for a, b in zip(rounds, base_rounds)]
        ratios = [r for r in ratios if r is not None]
        return statistics.median(ratios) if ratios else None
    return _ratio(level["output_throughput"], base["output_throughput"])


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return value / base if value is not None and base else None


def _fmt(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def not_run(comparison: dict) -> list[str]:
    """A line for each configuration that did not run, saying why."""
    return [f"{c['name']} ({c['status']}): {c['error'].splitlines()[0]}"
            for c in comparison["configurations"] if not c["result"]]


def comparison_table(comparison: dict) -> Table:
    header, rows = throughput_rows(comparison)
    table = Table(title="output tokens/s")
    for column in header:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def comparison_markdown(comparison: dict) -> str:
    header, rows = throughput_rows(comparison)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Configurations (`specserve serve` flags):", ""]
    lines += [f"- {c['name']}: `{c['flags'] or '(none)'}`" + ("" if c["result"] else f" ({c['status']})")
              for c in comparison["configurations"]]
    missing = not_run(comparison)
    if missing:
        lines += ["", "Not run:", ""] + [f"- {line}" for line in missing]
    return "\n".join(lines) + "\n"


def plot_throughput(comparison: dict, path: str) -> None:
    """A PNG of output tokens/s against concurrency (log x), one line per configuration that ran."""
    throughput_figure(comparison).savefig(path)


def throughput_figure(comparison: dict):
    """The plot's matplotlib Figure: the x axis is labelled at the measured concurrency levels."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=120)
    ax = fig.subplots()
    measured = set()
    for c in comparison["configurations"]:
        if c["result"]:
            levels = c["result"]["levels"]
            ax.plot([lv["concurrency"] for lv in levels], [lv["output_throughput"] for lv in levels], marker="o",
                    label=c["name"])
            measured.update(lv["concurrency"] for lv in levels)
    ax.set_xscale("log")
    label_levels(ax, sorted(measured))
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("specserve compare")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    return fig


def label_levels(ax, levels: list[int]) -> None:
    """Ticks and labels at exactly `levels` on the (log) x axis, no others."""
    if levels:
        ax.set_xticks(levels, labels=[str(level) for level in levels])
        ax.set_xticks([], minor=True)
