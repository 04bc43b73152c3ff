"""The KV pool's size from a GPU's memory: the default (85% of what is free after the weights) and vLLM's
gpu_memory_utilization (85% of what the engine's share of the whole GPU leaves after what is on it already);
the options that size the pool exclude each other, and gpu_memory_utilization is refused off CUDA."""
from __future__ import annotations

import gc

import pytest
import torch

from specserve import ConfigError
from specserve.assets import default_model_path
from specserve.engine.model_runner import KV_SHARE, kv_budget

from .conftest import DEVICE, make_llm

GIB = 2**30


def test_budget_of_the_free_memory_or_of_the_share():
    assert kv_budget(60 * GIB, 80 * GIB, None) == pytest.approx(0.85 * 60 * GIB)
    assert kv_budget(60 * GIB, 80 * GIB, 0.5) == pytest.approx(0.85 * 20 * GIB)  # 40 of 80, 20 in use
    assert kv_budget(60 * GIB, 80 * GIB, 1.0) == kv_budget(60 * GIB, 80 * GIB, None)
    with pytest.raises(ConfigError, match=r"gives this engine 16.0 GiB of the GPU's 80.0, and 20.0 GiB are in use"):
        kv_budget(60 * GIB, 80 * GIB, 0.2)


@pytest.mark.parametrize("options, message", [
    ({"gpu_memory_utilization": 0}, r"must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 0.5, "kv_cache_gb": 1}, "kv_cache_gb and gpu_memory_utilization both size"),
])
def test_bad_sizes_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        make_llm(default_model_path(), **options)


@pytest.mark.skipif(DEVICE["name"] == "cuda", reason="off CUDA only")
def test_gpu_memory_utilization_is_refused_off_cuda():
    with pytest.raises(ConfigError, match="gpu_memory_utilization sizes the KV pool from a GPU's memory; the device "
                                          "is cpu: give kv_cache_gb"):
        make_llm(default_model_path(), gpu_memory_utilization=0.5)


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="a GPU's memory (--device cuda)")
def test_the_pool_grows_with_the_share_by_its_85_percent():
    """Engines given a share of 512 MiB, then 1 GiB, more than what the GPU holds before each starts: their pools
    differ by 85% of the 512 MiB between the shares (what each engine holds before sizing, weights and buffers, is
    the same), and none exceeds 85% of its share. A first engine warms the process (the CUDA context's one-time
    growth would count against its share alone). The default would take 85% of all free memory (here capped only
    by max_num_seqs x max_model_len: 4 GiB)."""
    pools = []
    for share in (2**30, 2**29, 2**30):
        free, total = torch.cuda.mem_get_info()
        llm = make_llm(default_model_path(), gpu_memory_utilization=(total - free + share) / total,
                       max_num_seqs=1024, enforce_eager=True, speculative_algorithm="none")
        pools.append(llm.engine.runner.kv_cache.nbytes)
        assert 0 < pools[-1] <= KV_SHARE * share
        llm.engine.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert abs(pools[2] - pools[1] - KV_SHARE * 2**29) <= 2**20, pools
