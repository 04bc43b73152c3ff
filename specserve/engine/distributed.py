"""Tensor-parallel ranks: starting them, sending them work, noticing when one dies, and ending them.

Rank 0 is the engine process: it schedules, and its model runner sends every other rank each call it
makes on the model (`Ranks.send`: the step's plain inputs, pickled, broadcast over a gloo control group),
then runs the call itself; ranks 1..N-1 build the same model runner on their shard and run what arrives
(`worker.serve`). The layers' collectives use a second group: NCCL on CUDA (rank r on cuda:r), gloo on CPU.

Ranks meet through a torch.distributed TCP store. Started alone, rank 0 opens the store on a free port and
starts ranks 1..N-1 itself (`python -m specserve.engine.worker`, the launch spec on stdin). Under torchrun
(or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) every rank is started by the
launcher and they meet at MASTER_ADDR:MASTER_PORT.

Lifetime: a worker started by rank 0 ignores SIGINT and SIGTERM (rank 0 drains, then ends it) and exits
at once (code 0) when its stdin closes, which happens when rank 0 closes the group or dies. Rank 0 waits on
every worker it started; one that exits unasked (or fails while the group closes: its death may be why)
sets `failure`, the other workers are ended, and every later `send` raises. Under a launcher, a lost rank
shows as a failed collective instead.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..layers.parallel import TensorParallel

log = logging.getLogger(__name__)

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
START_TIMEOUT = datetime.timedelta(minutes=10)  # ranks loading their shards, or other nodes starting
STEP_TIMEOUT = datetime.timedelta(minutes=10)  # one collective of the model
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for rank 0's next call
STOP_WAIT_S = 5.0  # a closed worker's time to exit before it is killed
MESSAGE_BYTES = 1 << 16  # one broadcast carries a call this long (length included); longer ones take two


def launcher_rank() -> Optional[int]:
    """This process's rank when a launcher (torchrun) started it, else None."""
    if not all(v in os.environ for v in LAUNCHER_VARIABLES):
        return None
    return int(os.environ["RANK"])


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    if config.model.device != "cuda":
        return torch.device(config.model.device)
    local = int(os.environ.get("LOCAL_RANK", rank)) if launcher_rank() is not None else rank
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _await_ranks(store, size: int, workers: list[subprocess.Popen]) -> None:
    """Wait until every rank is about to join the groups (which hold the GIL while they wait for all ranks),
    failing at once if a worker this rank started exits first."""
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    while not store.check([f"up/{r}" for r in range(size)]):
        for rank, proc in enumerate(workers, 1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every tensor-parallel rank started within {START_TIMEOUT}")
        time.sleep(0.02)


class Ranks:
    """The tensor-parallel group as one rank sees it: `tp` for the layers, `send` / `receive` for calls."""

    def __init__(self, config: EngineConfig, rank: int, store, workers: list[subprocess.Popen] = ()):
        self.rank, self.size = rank, config.parallel.tensor_parallel_size
        self.failure: Optional[str] = None  # why the group broke (a rank exited), once it has
        self.workers = list(workers)  # the processes of ranks 1..N-1 when this rank started them
        self._closed = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one message at a time on the control group
        self._killed: set[subprocess.Popen] = set()  # workers that did not exit when asked, killed here
        self.device = rank_device(config, rank)
        self._threads = torch.get_num_threads()
        if self.device.type == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, self._threads // self.size))
        store.set(f"up/{rank}", "1")
        if rank == 0:
            _await_ranks(store, self.size, self.workers)
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, self.size, IDLE_TIMEOUT)
        if self.device.type == "cuda":
            data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, self.size)
        else:
            data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, self.size, STEP_TIMEOUT)
        self.control = control
        self.tp = TensorParallel(rank, self.size, data)
        for i, proc in enumerate(self.workers):
            threading.Thread(target=self._watch, args=(i + 1, proc), name=f"specserve-rank{i + 1}",
                             daemon=True).start()
        if rank == 0:
            atexit.register(self.close)

    # ---- starting -----------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig) -> "Ranks":
        """Rank 0's group: joined through the launcher's variables, or with ranks 1..N-1 started here."""
        size = config.parallel.tensor_parallel_size
        if launcher_rank() is not None:
            store, rank, world = next(dist.rendezvous("env://", timeout=START_TIMEOUT))
            if rank != 0 or world != size:
                raise ValueError(f"the launcher says rank {rank} of {world}; the engine runs on rank 0 of "
                                 f"tensor_parallel_size {size}")
            return cls(config, 0, store)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=START_TIMEOUT, wait_for_workers=False)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        workers = []
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", "specserve.engine.worker"], stdin=subprocess.PIPE,
                                        env=env)
                workers.append(proc)
                proc.stdin.write(pickle.dumps((config, rank, store.port)))
                proc.stdin.flush()  # stdin stays open: its end tells the worker to exit
            return cls(config, 0, store, workers)
        except BaseException:
            for proc in workers:
                proc.kill()
                proc.wait()
            raise

    # ---- calls --------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Rank 0: hand `message` to every other rank (they get it from `receive`)."""
        if self.failure is not None:
            raise RuntimeError(f"tensor parallelism is broken: {self.failure}")
        data = pickle.dumps(message)
        head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)  # [length: 8 bytes little-endian][data...]
        head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        first = min(len(data), MESSAGE_BYTES - 8)
        if first:
            head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        with self._send_lock:
            self.control.broadcast(head, 0).wait()
            if len(data) > first:
                self.control.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), 0).wait()

    def receive(self) -> Any:
        """Ranks 1..N-1: the next message rank 0 sent."""
        head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        self.control.broadcast(head, 0).wait()
        raw = head.numpy().tobytes()
        length = int.from_bytes(raw[:8], "little")
        data = raw[8:8 + length]
        if length > len(data):
            rest = torch.empty(length - len(data), dtype=torch.uint8)
            self.control.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def min(self, value: int) -> int:
        """The smallest of every rank's value (a collective)."""
        x = torch.tensor([value], dtype=torch.long)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([x], options).wait()
        return int(x)

    # ---- ending -------------------------------------------------------------------------------
    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        """A worker that exits while the group is open, or fails (non-zero, not killed here) even while it
        closes (its death may be what closed it), breaks the group."""
        code = proc.wait()  # reaps it: no zombie
        with self._lock:
            if (self._closed and (code == 0 or proc in self._killed)) or self.failure is not None:
                return
            self.failure = f"tensor-parallel rank {rank} exited with code {code}"
        log.error("%s; ending the other ranks", self.failure)
        self._end_workers()

    def close(self) -> None:
        """End the group: every worker this rank started exits (killed if it has not within seconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        torch.set_num_threads(self._threads)
        if self.rank == 0 and not self.workers and self.failure is None:
            try:  # ranks started by a launcher: ask them to stop
                self.send(None)
            except Exception:  # already gone
                pass
        self._end_workers()

    def _end_workers(self) -> None:
        for proc in self.workers:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.workers:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                with self._lock:
                    self._killed.add(proc)
                proc.kill()
                proc.wait()
