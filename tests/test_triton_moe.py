"""The fused Triton MoE experts against a per-token torch reference: random and skewed routing, fp32 and bf16,
CUDA-graph replay with new routing. The fused router (`route`) against torch's softmax and topk.

Runs on CUDA (`--device cuda`); on CPU only under Triton's interpreter (TRITON_INTERPRET=1), with small shapes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.engine.cuda_graph import capture_all
from specserve.layers import triton_moe

from .conftest import DEVICE, INTERPRET, kernel_marks

needs_kernels, needs_cuda = kernel_marks()


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
@pytest.mark.parametrize("n,top_k", [(2, 2), (5, 2), (40, 4)])
def test_half(n, top_k, dtype):
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("Triton's interpreter does bf16 arithmetic (tl.dot, *) on the raw uint16 bits")
    check(n, 8, top_k, 256, 96, dtype)


@needs_kernels
@pytest.mark.parametrize("n,num_experts,top_k", [(1, 16, 8), (2, 8, 2), (2, 16, 8)])
@pytest.mark.parametrize("strided", [False, True])
def test_direct_kernels_for_a_few_tokens(monkeypatch, n, num_experts, top_k, strided):
    """At most DIRECT_TOKENS tokens skip the layout by expert (two launches); the same sums as the reference
    and, within fp32 rounding, as the layout path (hidden and intermediate not multiples of the blocks). The
    two paths sum over K in different block orders: on the H200 one output of 400 differed by 1.07e-6."""
    check(n, num_experts, top_k, 200, 72, torch.float32, strided=strided)
    device = torch.device(DEVICE["name"])
    w13, w2 = make_weights(num_experts, 200, 72, torch.float32, device)
    x = torch.randn(n, 200, device=device)
    weights, experts = random_routing(n, num_experts, top_k, device)
    direct = triton_moe.fused_experts(x, w13, w2, weights, experts)
    monkeypatch.setattr(triton_moe, "DIRECT_TOKENS", 0)
    torch.testing.assert_close(direct, triton_moe.fused_experts(x, w13, w2, weights, experts), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("n,num_experts,top_k", [(1, 16, 8), (2, 8, 2)])
def test_direct_fused_is_the_norm_the_experts_and_the_residual_add(n, num_experts, top_k):
    """`direct_fused` (the decoder path of a few tokens): the experts of the stream normed by its rms, given as
    the stream times the norm weight and the stream's sums of squares in parts, plus the stream; and the next
    norm's inputs (parts of the new stream's squares, it times the next weight), as the layered path computes
    them with an RMSNorm before and an add after (fp32: within rounding)."""
    device = torch.device(DEVICE["name"])
    hidden, inter = 200, 72
    w13, w2 = make_weights(num_experts, hidden, inter, torch.float32, device)
    stream = torch.randn(n, hidden, device=device)  # [n, hidden]
    norm_w, next_w = torch.rand(hidden, device=device) + 0.5, torch.rand(hidden, device=device) + 0.5
    weights, experts = random_routing(n, num_experts, top_k, device)
    sq = stream.pow(2)
    parts = torch.stack([sq[:, :77].sum(1), sq[:, 77:].sum(1)], 1)  # [n, 2] the sums of squares in two pieces
    normed = stream / torch.sqrt(sq.mean(1, keepdim=True) + 1e-6) * norm_w
    want = stream + triton_moe.fused_experts(normed, w13, w2, weights, experts)
    got, got_parts, scaled = triton_moe.direct_fused(stream * norm_w, (parts, 1e-6), w13, w2, weights, experts,
                                                     stream, next_w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_parts.sum(1), want.pow(2).sum(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scaled, got * next_w, rtol=1e-6, atol=1e-6)
    last, last_parts, none = triton_moe.direct_fused(stream * norm_w, (parts, 1e-6), w13, w2, weights, experts,
                                                     stream, None)
    assert none is None and torch.equal(last, got) and torch.equal(last_parts, got_parts)


@needs_cuda
def test_cuda_graph_replays_new_routing():
    device, dtype = torch.device(DEVICE["name"]), torch.bfloat16
    n, num_experts, top_k, hidden, inter = 24, 16, 4, 256, 96
    torch.manual_seed(0)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, device)
    x = torch.randn(n, hidden, device=device, dtype=dtype)
    weights, experts = random_routing(n, num_experts, top_k, device)
    weights = weights.to(dtype)
    graphs, outputs = capture_all([()], lambda: triton_moe.fused_experts(x, w13, w2, weights, experts))
    graph, out = graphs[()], outputs[()]
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


def route_reference(logits, top_k, renormalize, out_dtype):
    """torch's router: softmax in fp32, topk, optional renormalisation."""
    weights, experts = torch.topk(torch.softmax(logits.float(), -1), top_k)  # [n, top_k] each
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(out_dtype), experts


def distinct_logits(n, num_experts, dtype, device):
    """[n, num_experts] logits with no ties within a row in `dtype`: random normal in fp32; in half precision
    num_experts distinct values of that dtype in [-4, 4], drawn at random for each row."""
    if dtype == torch.float32:
        logits = torch.randn(n, num_experts)
    else:
        pool = torch.linspace(-4, 4, 100_000).to(dtype).unique()  # [values]
        logits = pool[torch.rand(n, pool.numel()).argsort(-1)[:, :num_experts]]
    assert all(row.unique().numel() == num_experts for row in logits)
    return logits.to(device)


def check_route(logits, top_k, renormalize, out_dtype):
    weights, experts = triton_moe.route(logits, top_k, renormalize, out_dtype)
    ref_weights, ref_experts = route_reference(logits, top_k, renormalize, out_dtype)
    assert experts.dtype == torch.int32 and weights.dtype == out_dtype
    assert torch.equal(experts.long(), ref_experts)
    if out_dtype == torch.float32:
        torch.testing.assert_close(weights, ref_weights, rtol=5e-6, atol=1e-7)
    else:
        torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=1e-2, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("n", [1, 5, 33])
def test_route_fp32(n, num_experts, top_k, renormalize):
    torch.manual_seed(n * 1000 + num_experts * 10 + top_k)
    check_route(distinct_logits(n, num_experts, torch.float32, DEVICE["name"]), top_k, renormalize, torch.float32)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (512, 8)])
def test_route_half(num_experts, top_k, renormalize, dtype):
    """Half-precision logits, weights in the same dtype (as the MoE block asks)."""
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("Triton's interpreter does bf16 arithmetic on the raw uint16 bits")
    torch.manual_seed(num_experts + top_k)
    check_route(distinct_logits(33, num_experts, dtype, DEVICE["name"]), top_k, renormalize, dtype)


@needs_kernels
def test_route_strided_logits_and_ties():
    """A column-strided view reaches the kernel; tied probabilities go to the lower expert index first (a stable
    descending sort), and a row of equal logits routes to experts 0..top_k-1 with equal weights."""
    torch.manual_seed(0)
    logits = torch.randint(0, 4, (9, 2 * 16)).float().to(DEVICE["name"])[:, ::2]  # [9, 16], many ties
    logits[0] = 0.0
    weights, experts = triton_moe.route(logits, 4, False, torch.float32)
    order = torch.sort(logits, stable=True, descending=True).indices[:, :4]  # softmax keeps the order
    assert torch.equal(experts.long(), order)
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(1, order), rtol=5e-6, atol=1e-7)
    assert experts[0].tolist() == [0, 1, 2, 3]


@needs_cuda
def test_route_cuda_graph_replays_new_logits():
    n, num_experts, top_k = 16, 128, 8
    torch.manual_seed(0)
    logits = distinct_logits(n, num_experts, torch.float32, "cuda")
    graphs, outputs = capture_all([()], lambda: triton_moe.route(logits, top_k, True, torch.bfloat16))
    graph, (weights, experts) = graphs[()], outputs[()]
    for _ in range(3):
        logits.copy_(distinct_logits(n, num_experts, torch.float32, "cuda"))
        graph.replay()
        ref_weights, ref_experts = route_reference(logits, top_k, True, torch.bfloat16)
        assert torch.equal(experts.long(), ref_experts)
        torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=1e-2, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_triton_router_matches_torch(norm_topk_prob):
    """SparseMoeBlock on CUDA: the Triton path (no grad) against the torch path (grad enabled), fp32."""
    from specserve.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(64, 16, 4, 24, norm_topk_prob).to(DEVICE["name"])
    for param in block.parameters():
        param.data.normal_(0, 0.125)
    x = torch.randn(7, 64, device=DEVICE["name"])
    with torch.no_grad():
        fused = block(x)
    with torch.enable_grad():
        eager = block(x)
    torch.testing.assert_close(fused, eager.detach(), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,top_k,hidden", [(1, 8, 200), (3, 2, 1500), (2, 1, 64)])
def test_sum_experts_adds_each_tokens_rows_then_rounds_once(n, top_k, hidden, dtype):
    """Each token's top_k rows summed: exactly, on integers (any order gives them, so a wrong row or column shows);
    on random fp32 partials rounded to bf16 once, as the torch sum and cast it replaces."""
    if dtype == torch.bfloat16 and INTERPRET:
        pytest.skip("Triton's interpreter does bf16 arithmetic on the raw uint16 bits")
    device = torch.device(DEVICE["name"])
    whole = torch.randint(-50, 50, (n * top_k, hidden), device=device).float()  # [n * top_k, hidden]
    want = whole.view(n, top_k, hidden).sum(1).to(dtype)
    assert torch.equal(triton_moe.sum_experts(whole, top_k, dtype), want)
    part = torch.randn(n * top_k, hidden, device=device)
    exact = part.double().view(n, top_k, hidden).sum(1)  # [n, hidden]
    torch.testing.assert_close(triton_moe.sum_experts(part, top_k, dtype), exact.to(dtype),
                               **({"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}))
