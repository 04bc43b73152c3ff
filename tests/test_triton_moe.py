"""The fused Triton MoE experts against a per-token torch reference: random and skewed routing, fp32 and bf16,
CUDA-graph replay with new routing.

Runs on CUDA (`--device cuda`); on CPU only under Triton's interpreter (TRITON_INTERPRET=1), with small shapes.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import triton_moe

from .conftest import DEVICE

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(
    not triton_moe.available() or not (DEVICE["name"] == "cuda" or INTERPRET),
    reason="the Triton kernels run on CUDA (--device cuda), or on CPU under TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not triton_moe.available() or DEVICE["name"] != "cuda" or INTERPRET,
                                reason="compiled for CUDA only (--device cuda, no TRITON_INTERPRET)")


def reference(x, w13, w2, weights, experts):
    """fp32, one token and one expert at a time."""
    x, w13, w2, weights = x.float(), w13.float(), w2.float(), weights.float()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t, row in enumerate(experts.tolist()):
        for k, e in enumerate(row):
            gate, up = (w13[e] @ x[t]).split(inter)
            out[t] += weights[t, k] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_routing(n, num_experts, top_k, device, skew=None):
    """weights [n, top_k] and experts [n, top_k], distinct within a token. skew 'one': every token's first
    choice is expert 1; 'same': every token has the same top_k experts (the others get none)."""
    experts = torch.rand(n, num_experts).topk(top_k, dim=1).indices
    if skew == "one":
        experts = torch.where(experts == 1, experts[:, :1], experts)
        experts[:, 0] = 1
    elif skew == "same":
        experts = torch.randperm(num_experts)[:top_k].expand(n, top_k).clone()
    return torch.rand(n, top_k, device=device), experts.to(device)


def make_weights(num_experts, hidden, inter, dtype, device, strided=False):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) / inter ** 0.5).to(dtype)
    if strided:  # non-contiguous layouts: strides reach the kernels
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    return w13, w2


def check(n, num_experts, top_k, hidden, inter, dtype, skew=None, strided=False, index_dtype=torch.int64):
    device = torch.device(DEVICE["name"])
    torch.manual_seed(n * 1000 + num_experts * 10 + top_k)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, device, strided)
    x = torch.randn(n, 2 * hidden if strided else hidden, device=device).to(dtype)
    if strided:
        x = x[:, ::2]
    weights, experts = random_routing(n, num_experts, top_k, device, skew)
    weights = weights.to(dtype)
    out = triton_moe.fused_experts(x, w13, w2, weights, experts.to(index_dtype))
    ref = reference(x, w13, w2, weights, experts)
    assert out.dtype == dtype and out.shape == (n, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("n,num_experts,top_k", [(1, 8, 1), (1, 16, 8), (3, 8, 2), (17, 16, 8), (64, 8, 2),
                                                 (64, 16, 8), (300, 128, 8)])
def test_align_blocks(n, num_experts, top_k):
    _, experts = random_routing(n, num_experts, top_k, DEVICE["name"], skew="one" if top_k > 1 else None)
    flat = experts.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    for block_m in (16, 64):
        sorted_ids, block_expert = (t.cpu() for t in triton_moe.align_blocks(experts, num_experts, block_m))
        assert sorted_ids.dtype == block_expert.dtype == torch.int32
        assert sorted_ids.shape[0] == block_expert.shape[0] * block_m
        blocks = sorted_ids.view(-1, block_m)
        valid = blocks < n * top_k
        assert sorted(blocks[valid].tolist()) == list(range(n * top_k))  # each assignment once
        owner = flat[blocks.clamp(max=n * top_k - 1).long()]
        assert (owner[valid] == block_expert[:, None].expand_as(owner)[valid].long()).all()
        used = int((-(-counts // block_m)).sum())  # the least number of blocks
        assert valid[:used, 0].all() and not valid[used:].any()
        assert (block_expert[used:] == num_experts).all()


@needs_kernels
@pytest.mark.parametrize("n,num_experts,top_k", [(1, 8, 1), (1, 16, 8), (3, 8, 2), (17, 16, 8), (64, 8, 2),
                                                 (64, 16, 8)])
def test_random_routing_fp32(n, num_experts, top_k):
    check(n, num_experts, top_k, 64, 24, torch.float32)


@needs_kernels
@pytest.mark.parametrize("n,num_experts,top_k,skew", [(17, 8, 1, "one"), (33, 8, 2, "one"), (64, 16, 2, "same"),
                                                      (5, 16, 8, "one")])
def test_skewed_routing_fp32(n, num_experts, top_k, skew):
    """Empty experts, one expert in every token, groups spanning several blocks."""
    check(n, num_experts, top_k, 64, 24, torch.float32, skew=skew)


@needs_kernels
def test_strides_and_int32_experts():
    check(9, 8, 2, 64, 24, torch.float32, strided=True, index_dtype=torch.int32)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,top_k", [(5, 2), (40, 4)])
def test_half(n, top_k, dtype):
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("Triton's interpreter does bf16 arithmetic (tl.dot, *) on the raw uint16 bits")
    check(n, 8, top_k, 256, 96, dtype)


@needs_cuda
def test_cuda_graph_replays_new_routing():
    device, dtype = torch.device("cuda"), torch.bfloat16
    n, num_experts, top_k, hidden, inter = 24, 16, 4, 256, 96
    torch.manual_seed(0)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, device)
    x = torch.randn(n, hidden, device=device, dtype=dtype)
    weights, experts = random_routing(n, num_experts, top_k, device)
    weights = weights.to(dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels and warm the allocator outside the capture
        triton_moe.fused_experts(x, w13, w2, weights, experts)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_experts(x, w13, w2, weights, experts)
    for skew in (None, "one", None, "same"):
        new_weights, new_experts = random_routing(n, num_experts, top_k, device, skew)
        x.copy_(torch.randn_like(x))
        weights.copy_(new_weights)
        experts.copy_(new_experts)
        graph.replay()
        eager = triton_moe.fused_experts(x, w13, w2, weights, experts)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), reference(x, w13, w2, weights, experts), rtol=2e-2, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("n", [1, 8, 256])
def test_large_bf16(n):
    check(n, 128, 8, 2048, 768, torch.bfloat16)
