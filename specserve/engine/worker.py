"""A tensor-parallel worker (ranks 1..N-1): build the model runner on this rank's shard, then run every call
rank 0 sends until it sends None or goes away (see `distributed`).

Started by rank 0 as `python -m specserve.engine.worker`: the launch spec (resolved config, rank, store
port) arrives pickled on stdin, and the worker exits as soon as stdin closes. Started by a launcher
(torchrun), `specserve serve` / `generate` on ranks other than 0 call `run_launched`.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading

import torch.distributed as dist

from ..config import EngineConfig
from ..models import ArchConfig, read_config
from .distributed import START_TIMEOUT, Ranks
from .machine import resolve_config
from .model_runner import ModelRunner


def serve(config: EngineConfig, ranks: Ranks) -> None:
    """Build this rank's model runner and run rank 0's calls: (method name, arguments), None to stop."""
    runner = ModelRunner(config, ArchConfig.from_dict(read_config(config.model.model)), ranks)
    while (message := ranks.receive()) is not None:
        name, args = message
        getattr(runner, name)(*args)


def run_launched(config: EngineConfig) -> int:
    """A launcher started this process as a rank other than 0: serve rank 0 until it stops."""
    config = resolve_config(config)
    store, rank, _ = next(dist.rendezvous("env://", timeout=START_TIMEOUT))
    serve(config, Ranks(config, rank, store))
    return 0


def _exit_when_stdin_closes() -> None:
    sys.stdin.buffer.read()  # returns when rank 0 closes the pipe or dies
    os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when this process ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, rank, port = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_when_stdin_closes, name="specserve-stdin", daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, config.parallel.tensor_parallel_size, False, timeout=START_TIMEOUT)
    serve(config, Ranks(config, rank, store))


if __name__ == "__main__":
    main()
