"""Tensor parallelism on CPU over gloo: two ranks give the same greedy tokens as one, with and without
speculation; the speculation controller sees what communication costs; a lost rank ends the server
with a non-zero code and no process is left behind."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers.parallel import TensorParallel

from .conftest import DEVICE, make_hf_checkpoint, make_llm, mixed_prompts

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or (DEVICE["name"] == "cuda" and torch.cuda.device_count() < 2),
    reason="needs torch.distributed, and two GPUs on CUDA")

TEXT_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, greedy(max_tokens))]


def process_gone(proc, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll() is not None


@pytest.fixture(scope="module")
def few_kv_heads(tmp_path_factory) -> str:
    """One KV head for two ranks (replicated), tied embeddings, and a vocabulary that does not divide by 2."""
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "kv1"), "llama", seed=7, vocab=255, tie=True,
                              kv_heads=1)


# ---- same tokens --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "one-kv-head"])
def test_two_ranks_equal_one(arch, hf_models, few_kv_heads):
    path = few_kv_heads if arch == "one-kv-head" else hf_models[arch]
    prompts = mixed_prompts(4, 255, seed=3)
    expected = token_ids(make_llm(path), prompts, 24)
    llm = make_llm(path, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.model.layers[0].self_attn.heads == 2  # really sharded
        assert token_ids(llm, prompts, 24) == expected
    finally:
        llm.engine.close()


def test_shards_and_refusals_of_each_rank():
    """Rank 1 of 2 takes the second half of q and of the MLP's parts, the one KV head whole, the second half
    of the vocabulary (padded); a checkpoint tensor of the wrong height is refused at any rank."""
    from specserve.layers.embedding import VocabParallelEmbedding
    from specserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ShapeMismatch
    from specserve.layers.parallel import building

    with building(TensorParallel(rank=1, size=2)):
        qkv = QKVParallelLinear(hidden=3, head_dim=2, num_heads=4, num_kv_heads=1)
        mlp = MergedColumnParallelLinear(3, [4, 4])
        embed = VocabParallelEmbedding(5, 3)
    rows = lambda n: torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3)  # noqa: E731  row i = i
    for part, n in (("q", 8), ("k", 2), ("v", 2)):
        qkv.load(qkv.weight, rows(n), part)
    assert qkv.weight[:, 0].tolist() == [4, 5, 6, 7, 0, 1, 0, 1]  # q heads 2-3, then the shared k and v
    mlp.load(mlp.weight, rows(4), 0)
    mlp.load(mlp.weight, rows(4) + 10, 1)
    assert mlp.weight[:, 0].tolist() == [2, 3, 12, 13]
    embed.load(embed.weight, rows(5))
    assert embed.weight[:, 0].tolist() == [3, 4, 0]  # rows 3-4 and a zero pad
    with pytest.raises(ShapeMismatch):
        qkv.load(qkv.weight, rows(10), "q")
    with pytest.raises(ShapeMismatch):
        mlp.load(mlp.weight, rows(6), 1)


@pytest.fixture(scope="module")
def default_plain() -> list[list[int]]:
    """The shipped target's greedy tokens on one rank without speculation: what every run must match."""
    return token_ids(make_llm(None, speculative_algorithm="none"), TEXT_PROMPTS, 32)


@pytest.mark.parametrize("options", [
    dict(speculative_algorithm="none"),
    dict(),  # the shipped drafter, adaptive: plain and speculative steps mixed
    dict(speculative_policy="always", speculative_eagle_topk=2, speculative_num_draft_tokens=6),  # a tree
], ids=["plain", "adaptive", "tree"])
def test_default_pair_on_two_ranks(options, default_plain):
    llm = make_llm(None, tensor_parallel_size=2, **options)
    try:
        assert token_ids(llm, TEXT_PROMPTS, 32) == default_plain
        if "speculative_algorithm" not in options:
            assert llm.engine.stats.spec.num_drafts > 0
    finally:
        llm.engine.close()


# ---- the cost of communication --------------------------------------------------------------------
def speculating_share(llm: LLM) -> float:
    """Of the decode steps of one request at a time, the share that verified drafts. Acceptance is pinned
    at 0.6 per position (a chain of 1 / 2 / 3 gains 1.6 / 2.0 / 2.2 tokens), so that only the step times decide."""
    llm.engine.spec.controller.pin_acceptance([0.6])
    llm.generate(TEXT_PROMPTS[0], greedy(8))  # warm
    for prompt in TEXT_PROMPTS[1:]:
        llm.generate(prompt, greedy(20))
    stats = llm.engine.stats
    return stats.spec.num_drafts / stats.num_steps


@pytest.mark.skipif(DEVICE["name"] == "cuda", reason="CUDA graphs replay the collectives without Python: "
                    "a patched all_reduce would slow only the eager (prefill) steps")
def test_a_slow_link_makes_the_controller_speculate_less(monkeypatch):
    """The controller times whole steps on rank 0, communication included. With the link slowed to 0.2 MB/s
    (every all-reduce waits for its bytes on rank 0, so every rank waits) a verify of k+1 tokens per
    request costs more than k+1 plain steps, more than the 1.6 / 2.0 / 2.2 tokens it gains at k = 1 / 2 / 3
    (acceptance pinned at 0.6), and the controller turns to plain decoding; over the real link a verify of a few
    tokens costs little more than a plain step, and it speculates on most steps."""
    llm = make_llm(None, tensor_parallel_size=2)
    try:
        fast = speculating_share(llm)
    finally:
        llm.engine.close()
    real = TensorParallel.all_reduce

    def slow_all_reduce(self, x):
        time.sleep(x.numel() * x.element_size() / 0.2e6)
        return real(self, x)

    monkeypatch.setattr(TensorParallel, "all_reduce", slow_all_reduce)
    llm = make_llm(None, tensor_parallel_size=2)
    try:
        slow = speculating_share(llm)
    finally:
        llm.engine.close()
    print(f"share of steps that speculated: {fast:.2f} over the real link, {slow:.2f} over the slow one")
    assert slow < 0.15 and fast > 0.5, (fast, slow)


# ---- lifetime -------------------------------------------------------------------------------------
def test_close_ends_the_workers_and_a_lost_rank_is_reported(hf_models):
    llm = make_llm(hf_models["llama"], tensor_parallel_size=2)
    [worker] = llm.engine.runner.ranks.workers
    llm.engine.close()
    assert process_gone(worker) and worker.returncode == 0

    llm = make_llm(hf_models["llama"], tensor_parallel_size=2)
    try:
        [worker] = llm.engine.runner.ranks.workers
        worker.kill()
        deadline = time.monotonic() + 5
        while llm.engine.runner.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 1 exited with code -9" in llm.engine.runner.failure
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.generate([5, 6, 7], greedy(4))
    finally:
        llm.engine.close()


def test_calls_of_any_length_reach_every_rank():
    """Rank 0's calls travel pickled in one broadcast of MESSAGE_BYTES, or two when longer."""
    import pickle
    import subprocess
    import sys

    from specserve.config import EngineConfig
    from specserve.engine.distributed import MESSAGE_BYTES, Ranks

    messages = [("run", ([1, 2, 3],)), list(range(MESSAGE_BYTES)), b"x" * (MESSAGE_BYTES - 8 - 15), None]
    config = EngineConfig.from_options(tensor_parallel_size=2, device="cpu")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    script = ("import pickle, sys, torch.distributed as d\n"
              "from specserve.config import EngineConfig\n"
              "from specserve.engine.distributed import Ranks\n"
              f"ranks = Ranks(EngineConfig.from_options(tensor_parallel_size=2, device='cpu'), 1, "
              f"d.TCPStore('127.0.0.1', {store.port}, 2, False))\n"
              f"sys.stdout.buffer.write(pickle.dumps([ranks.receive() for _ in range({len(messages)})]))\n")
    peer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    ranks = Ranks(config, 0, store)
    for m in messages:
        ranks.send(m)
    received, _ = peer.communicate(timeout=60)
    ranks.close()
    assert pickle.loads(received) == messages


def test_workers_end_with_rank_0(tmp_path, hf_models):
    """SIGKILL of the engine process: its worker sees its stdin close and exits."""
    import subprocess
    import sys

    script = (f"from tests.conftest import make_llm\n"
              f"llm = make_llm({hf_models['llama']!r}, tensor_parallel_size=2)\n"
              f"print(llm.engine.runner.ranks.workers[0].pid, flush=True)\n"
              f"import time; time.sleep(60)\n")
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        worker = int(engine.stdout.readline())
        engine.kill()
        engine.wait()
        deadline = time.monotonic() + 10
        while running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(worker)
    finally:
        engine.kill()


def running(pid: int) -> bool:
    """Is pid a live process (not gone, not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from specserve.assets import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("model") / "tiny")
    make_tiny_checkpoint(path)
    return path


def test_server_on_two_ranks_serves_and_stops_cleanly(tmp_path, tiny):
    from .test_server import MODEL, ServerProcess

    [expected] = make_llm(tiny).generate(["def fibonacci(n):"], greedy(16))
    srv = ServerProcess(tmp_path / "server.log", "--model", tiny, "--tp", "2", "--device", DEVICE["name"],
                        "--dtype", "float32")
    try:
        srv.wait_ready()
        r = srv.client().completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.choices[0].text == expected.text
    finally:
        assert srv.stop() == 0, srv.output()  # SIGTERM: drains, ends the worker rank, exits 0


def test_a_killed_rank_ends_the_server_nonzero_within_seconds(tmp_path, tiny):
    from .test_server import MODEL, ServerProcess, children

    srv = ServerProcess(tmp_path / "server.log", "--model", tiny, "--tp", "2", "--device", DEVICE["name"],
                        "--dtype", "float32")
    try:
        srv.wait_ready()
        kids = children(srv.proc.pid)
        [worker] = [pid for pid in kids if "specserve.engine.worker" in cmdline(pid)]
        errors = []

        def stream():  # a request in flight when the rank dies gets an error, not a hang
            try:
                for _ in srv.client(timeout=30).completions.create(model=MODEL, prompt="x", max_tokens=1000,
                                                                   stream=True, extra_body={"ignore_eos": True}):
                    pass
            except Exception as e:
                errors.append(e)

        client = threading.Thread(target=stream)
        client.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert process_gone(srv.proc, 10), f"the server still runs 10 s after its rank died:\n{srv.output()}"
        took = time.monotonic() - t0
        client.join(30)
        assert srv.proc.returncode not in (0, None), srv.output()
        assert took < 10 and errors, (took, errors)
        alive = [pid for pid in kids if os.path.exists(f"/proc/{pid}")]
        assert not alive, f"the server left processes behind: {alive}"
        assert "rank 1 exited with code -9" in srv.output()
        print(f"the server exited {srv.proc.returncode} {took:.1f} s after its rank was killed")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
