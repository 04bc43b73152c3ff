"""The padded attention backend against a per-sequence reference, on steps that mix prefill chunks,
decode tokens and tree verifies (the rows are attended in groups of similar query length)."""
import torch

from specserve.layers.attention import build_metadata


def reference(q, cache, q_lens, seq_lens, tables, block_size, trees, scale):
    """Softmax attention of each sequence's new queries over its context, one sequence at a time."""
    out, start = [], 0
    for i, (n_q, n) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(n)
        slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
        keys, values = cache[0, slots], cache[1, slots]  # [n, kv_heads, dim]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        allowed = pos[None, :] <= torch.arange(n - n_q, n)[:, None]  # [n_q, n]
        if trees[i] is not None:
            allowed[:, n - trees[i].shape[1]:] = trees[i]
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n_q], keys) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += n_q
    return torch.cat(out)


def test_mixed_step_matches_per_sequence_attention():
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    q_lens = [1, 40, 4, 1, 20, 3]
    seq_lens = [9, 40, 17, 30, 45, 3]
    tables, next_block = [], 0
    for n in seq_lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block + blocks - 1, next_block - 1, -1)))  # out of order on purpose
        next_block += blocks
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    trees = [None, None, tree, None, None, None]
    cache = torch.randn(2, next_block * block_size, kv_heads, dim)
    tokens = sum(q_lens)
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    meta = build_metadata(q_lens, seq_lens, tables, block_size, torch.device("cpu"), trees)
    assert len(meta.groups) == 3  # 1-16, 17-32, 33-64 query tokens
    got = meta.attend(q, k, v, cache, dim ** -0.5)
    want = reference(q, cache, q_lens, seq_lens, tables, block_size, trees, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_lone_sequence_attends_without_padding_indices():
    """A step of one sequence (decode, a tree verify, a prefill chunk) takes the path that skips the padded
    gather of queries and the selection of valid outputs; the same result as the reference, with key 0
    hidden too (the EAGLE-3 draft's metadata)."""
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for q_len, n, trees in ((1, 9, [None]), (3, 17, [tree]), (12, 12, [None])):
        tables = [list(range(-(-n // block_size)))[::-1]]
        cache = torch.randn(2, len(tables[0]) * block_size, kv_heads, dim)
        q, k, v = torch.randn(q_len, heads, dim), torch.randn(q_len, kv_heads, dim), torch.randn(q_len, kv_heads, dim)
        meta = build_metadata([q_len], [n], tables, block_size, torch.device("cpu"), trees)
        assert meta.groups[0].alone
        got = meta.attend(q, k, v, cache, dim ** -0.5)  # writes k and v into the cache first
        want = reference(q, cache, [q_len], [n], tables, block_size, trees, dim ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if n > q_len:
            hidden = build_metadata([q_len], [n], tables, block_size, torch.device("cpu"), trees).without_first_key()
            cache[:, tables[0][0] * block_size] = 1e4  # key 0's slot: would dominate every softmax it entered
            got = hidden.attend(q, k, v, cache, dim ** -0.5)
            assert got.abs().max() < 1e3
