"""The linear product the layers use: F.linear's result in every orientation and shape it takes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.layers.linear import FEW_ROWS, linear


@pytest.mark.parametrize("shape", [(1, 48), (4, 48), (3, 1, 48), (2, 5, 48), (300, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_f_linear(shape, bias):
    """One row (F.linear itself), a few rows, leading dimensions, many rows; with and without bias."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(72, 48, generator=gen)
    b = torch.randn(72, generator=gen) if bias else None
    got = linear(x, w, b)
    assert got.shape == (*shape[:-1], 72)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 4, FEW_ROWS, FEW_ROWS + 1])
def test_few_rows_in_any_layout_give_a_row_major_result(rows):
    """A product's input may be a transposed view (another op's output); the result is F.linear's and row-major
    whatever the input's layout, so that the next product gets row-major rows: MKL's few-row kernel read a
    transposed input 2-3x slower (docs/performance.md, session 28)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(72, 48, generator=gen)
    for x in (torch.randn(rows, 48, generator=gen), torch.randn(48, rows, generator=gen).T):
        got = linear(x, w)
        assert got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_keeps_autograd_and_other_dtypes_on_f_linear():
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(4, 8)
    linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 8))
    half = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))


@pytest.mark.parametrize("rows", [1, 2, 4, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weights_give_the_product_of_their_dequantized_rows(rows, bias):
    """A layer quantized to int8 computes x @ (q * scale).T from bfloat16 rows: that product, up to the rounding
    of the rows and the result (a worked row below pins the scale rule). Its error against the fp32 layer stays
    within what rounding each weight to 1/254 of its row's largest magnitude allows."""
    from specserve.layers.linear import ReplicatedLinear

    gen = torch.Generator().manual_seed(0)
    layer = ReplicatedLinear(48, 72, bias=bias)
    layer.weight.data.copy_(torch.randn(72, 48, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(72, generator=gen))
    x = torch.randn(rows, 48, generator=gen)
    exact = layer(x)
    layer.quantize_int8()
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (72,)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 72)
    dequantized = layer.weight.float() * layer.weight_scale.float()[:, None]
    want = x.bfloat16().float() @ dequantized.T + (layer.bias if bias else 0)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()

    worked = ReplicatedLinear(16, 1)
    worked.weight.data.copy_(torch.tensor([[1.0, -0.5, 0.25] + [0.0] * 13]))
    worked.quantize_int8()  # the largest magnitude maps to 127
    assert worked.weight.tolist() == [[127, -64, 32] + [0] * 13]  # -63.5 rounds half to even, 31.75 to the nearest
    assert worked(torch.eye(16)[:3]).flatten().tolist() == pytest.approx([1.0, -64 / 127, 32 / 127], rel=1e-2)
    with pytest.raises(ValueError, match="multiples of 16"):
        ReplicatedLinear(20, 4).quantize_int8()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="one half-precision row runs as triton_gemv on CUDA")
@pytest.mark.parametrize("shape", [(1, 4096), (1, 1, 14336), (2, 4096), (5, 4096)])
def test_one_half_row_on_cuda_is_the_linear(shape):
    """One bf16 row on CUDA takes the Triton kernel (more rows take cuBLAS): F.linear's result in fp32 sums,
    bias and leading dimensions kept, the same bits as the kernel called directly."""
    from specserve.layers import linear as linear_module
    from specserve.layers import triton_gemv

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).cuda().bfloat16()
    w = (torch.randn(3000, shape[-1], generator=gen) / shape[-1] ** 0.5).cuda().bfloat16()
    b = torch.randn(3000, generator=gen).cuda().bfloat16()
    got = linear(x, w, b)
    want = F.linear(x.float(), w.float(), b.float())
    assert got.shape == (*shape[:-1], 3000) and got.dtype == torch.bfloat16
    assert (got.float() - want).norm() / want.norm() < 1e-2
    rows = x.numel() // shape[-1]
    assert linear_module._gemv_fits(x, w) == (rows == 1)
    if rows == 1:
        assert torch.equal(got, triton_gemv.gemv(x, w, b))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_store_kv_writes_the_full_projections_keys_and_values(qk_norm):
    """A decoder attention's store_kv projects k and v alone (the weight's rows after q's) and writes them
    rotated (k normed first with Qwen3's q/k norm) to their slots, as the whole q/k/v projection would: 4
    query heads per KV head, bias on, rows at scattered positions and slots; on CUDA through the fused kernel."""
    from specserve.layers.rotary import RotaryEmbedding
    from specserve.models.config import DecoderShape
    from specserve.models.llama import DecoderAttention

    from .conftest import DEVICE

    dev = torch.device(DEVICE["name"])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shape = DecoderShape(vocab_size=32, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2,
                         head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, 256, 10000.0, None)
    attn = DecoderAttention(shape, rotary, qkv_bias=True, qk_norm=qk_norm, layer=1)
    for p in attn.parameters():
        p.data.normal_(0, 0.2)
    attn = attn.to(dev, dtype)
    x = torch.randn(7, 128, device=dev, dtype=dtype)
    positions = torch.tensor([0, 5, 9, 100, 101, 37, 255], device=dev)
    slots = torch.tensor([3, 11, 4, 60, 0, 12, 40], device=dev)
    cache = torch.full((2, 2, 64, 2, 32), float("nan"), device=dev, dtype=dtype)
    attn.store_kv(x, positions, slots, cache)
    q, k, v = attn._split(attn.qkv_proj(x))
    _, want_k = rotary.to(dev)(positions, q, k)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[1, 0, slots].float(), want_k.float(), **tol)
    torch.testing.assert_close(cache[1, 1, slots].float(), v.float(), **tol)
    unwritten = torch.ones(64, dtype=torch.bool, device=dev)
    unwritten[slots] = False
    assert cache[1][:, unwritten].isnan().all() and cache[0].isnan().all(), "wrote outside the given slots"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the few-row decoder path runs on CUDA in half precision")
@pytest.mark.parametrize("qkv_bias,qk_norm,rows,moe", [(False, False, 1, False), (True, False, 1, False),
                                                       (False, True, 1, False), (False, False, 4, False),
                                                       (True, False, 11, False), (False, True, 4, False),
                                                       (False, True, 1, True), (False, True, 2, True),
                                                       (False, False, 1, True)])
def test_fused_decoder_path_is_the_layered_path(qkv_bias, qk_norm, rows, moe):
    """A step of 1-16 tokens on CUDA in bf16 runs every layer as four fused products (`LlamaModel.fused_rows`;
    one row on the FMA units, more on the tensor cores; rotary and the cache write in the q/k/v product's
    epilogue without q/k norm): the final hidden states, the aux streams and the cache agree with the
    layer-by-layer path over the same cache (bf16 roundings apart), for Llama, Qwen2 (q/k/v bias) and Qwen3
    (q/k norm); tokens of two sequences, one of them a verify's several. Qwen3-MoE (routed experts, a dense
    layer between) takes the path at one and two tokens, its experts' norms and sums fused
    (`triton_moe.direct_fused`); without q/k norm (as Mixtral) its rotary in the q/k/v product's epilogue."""
    from specserve.layers.attention import attention_backend
    from specserve.models.config import ArchConfig
    from specserve.models.registry import model_class

    dev = torch.device("cuda")
    raw = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": True,
           "mlp_only_layers": [1]} if moe else {}
    arch = "Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"
    c = ArchConfig(vocab_size=300, hidden_size=256, intermediate_size=704, num_layers=3, num_heads=8,
                   num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=256, architecture=arch, tie_word_embeddings=False,
                   qkv_bias=qkv_bias, qk_norm=qk_norm, eos_token_ids=(), raw=raw)
    torch.manual_seed(0)
    model = model_class(arch)(c)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    model = model.to(dev, torch.bfloat16).eval()
    cache = torch.randn(3, 2, 64, 2, 32, device=dev, dtype=torch.bfloat16)  # [layers, 2, slots, kv_heads, dim]
    q_lens = [1] if rows == 1 else [1, rows - 1]
    seq_lens = [21, 30][:len(q_lens)]
    ids = torch.randint(0, 300, (rows,), device=dev)
    positions = torch.tensor([20, *range(30 - rows + 1, 30)][:rows], device=dev)

    def run(fused: bool):
        kv = cache.clone()
        meta = attention_backend("triton").metadata(q_lens, seq_lens, [[0, 1], [2, 3]][:len(q_lens)], 16, dev,
                                                     group=4, kv_cache=kv)
        model.model.fused_rows = lambda h: fused
        try:
            with torch.inference_mode():
                out, aux = model(ids, positions, meta, aux_layers=(1, 3))
        finally:
            del model.model.fused_rows
        return out, aux, kv

    with torch.inference_mode():
        assert model.model.fused_rows(model.model.embed_tokens(ids))
    (got, got_aux, got_kv), (want, want_aux, want_kv) = run(True), run(False)
    for a, b in [(got, want), *zip(got_aux, want_aux), (got_kv, want_kv)]:
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2


def test_rotary_turns_q_and_k_together_and_regathers_changed_positions():
    """On a CPU q and k rotate side by side as one tensor, with cos/sin gathered once for a forward's layers:
    the same bits as rotating each alone; a positions tensor changed in place, or another one, is regathered."""
    from specserve.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(32, 128, 10000.0, None)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 8, 32, generator=gen), torch.randn(3, 2, 32, generator=gen)

    def alone(positions, x):
        cos, sin = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], dim=-1) * sin

    positions = torch.tensor([0, 7, 100])
    for _ in range(2):  # the second call reuses the gathered tables
        got_q, got_k = rot(positions, q, k)
        assert torch.equal(got_q, alone(positions, q)) and torch.equal(got_k, alone(positions, k))
    positions[1] = 50  # in place: the same tensor, other positions
    assert torch.equal(rot(positions, q, k)[0], alone(positions, q))
    other = torch.tensor([3, 4, 5])
    assert torch.equal(rot(other, q, k)[1], alone(other, k))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt products run on CUDA")
@pytest.mark.parametrize("rows,n,k", [(256, 28672, 4096), (256, 4096, 14336), (130, 3000, 512)])
def test_tuned_products_are_the_linear_and_tune_only_when_asked(monkeypatch, rows, n, k):
    """Many bf16 rows with TUNE_ROWS set: outside `tuning` a new shape runs torch's product (no plan made);
    inside it the shape gets a plan (a cuBLASLt algorithm or torch's), and from then on the product, tuned or
    not, is F.linear's to bf16 rounding, bias and leading rows kept, also when replayed from a CUDA graph."""
    from specserve.layers import cublaslt

    monkeypatch.setattr(cublaslt, "TUNE_ROWS", 128)
    monkeypatch.setattr(cublaslt, "_plans", {})
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).cuda().bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).cuda().bfloat16()
    b = torch.randn(n, generator=gen).cuda().bfloat16()
    want = F.linear(x.float(), w.float(), b.float())
    assert cublaslt.product(x, w) is None and not cublaslt._plans
    with cublaslt.tuning():
        got = linear(x, w, b)
    assert len(cublaslt._plans) == 1
    assert got.shape == (rows, n) and (got.float() - want).norm() / want.norm() < 1e-2
    assert cublaslt.product(x[:100], w) is None  # below TUNE_ROWS
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = linear(x, w, b)
    x.copy_(torch.randn(rows, k, generator=gen).cuda().bfloat16())
    graph.replay()
    want = F.linear(x.float(), w.float(), b.float())
    assert (replayed.float() - want).norm() / want.norm() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt products run on CUDA")
def test_each_variant_is_its_candidate_with_another_cluster_or_swizzle_and_the_same_product():
    """`LtMatmul.variants`: each differs from the candidate it came from only in cluster shape and swizzle, none
    repeats a candidate, and each computes F.linear's product to bf16 rounding (on Hopper there is at least one)."""
    from specserve.layers import cublaslt

    rows, n, k = 256, 6144, 4096
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).cuda().bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).cuda().bfloat16()
    want = F.linear(x.float(), w.float())
    mm = cublaslt.LtMatmul(rows, n, k)
    bases = [algo for algo, _ in mm.candidates(cublaslt.VARIED)]
    variants = mm.variants(bases)
    if torch.cuda.get_device_capability()[0] == 9:
        assert variants

    def without_cluster(algo):
        return {key: v for key, v in cublaslt.algo_config(algo).items() if key not in ("cluster", "swizzle")}

    configs = [cublaslt.algo_config(a) for a in bases]
    workspace = torch.empty(mm.workspace_bytes, dtype=torch.uint8, device="cuda")
    for algo, need in variants:
        config = cublaslt.algo_config(algo)
        assert config not in configs and need <= mm.workspace_bytes
        assert any(without_cluster(algo) == without_cluster(b) for b in bases)
        configs.append(config)
        y = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        mm.run(x, w, y, algo, workspace)
        assert (y.float() - want).norm() / want.norm() < 1e-2


def test_only_aligned_half_products_of_many_rows_are_tuned(monkeypatch):
    """The plan key: None below TUNE_ROWS, in fp32, for an operand off the alignment the candidates assume (a view
    one row in) and with tuning off; the shape and row stride otherwise."""
    from specserve.layers import cublaslt

    monkeypatch.setattr(cublaslt, "TUNE_ROWS", 128)
    def aligned(*shape):
        buf = torch.zeros(shape[0] * shape[1] + cublaslt.ALIGN, dtype=torch.bfloat16)
        start = -buf.data_ptr() % cublaslt.ALIGN // 2
        return buf[start:start + shape[0] * shape[1]].view(*shape)

    x, w = aligned(300, 64), aligned(32, 64)
    assert cublaslt._key(x, w) == (300, 32, 64, 64, torch.bfloat16, None)
    assert cublaslt._key(x[:127], w) is None
    assert cublaslt._key(x[1:], w) is None  # 128 bytes in
    assert cublaslt._key(x.float(), w.float()) is None
    monkeypatch.setattr(cublaslt, "TUNE_ROWS", None)
    assert cublaslt._key(x, w) is None
