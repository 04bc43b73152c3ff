"""Mixed CUDA graphs (engine/cuda_graph.py): steps of prompt chunks beside decode tokens, set into a mixed graph's
static inputs, compute what the same steps compute eagerly. The graph's body runs under Triton's interpreter
or on CUDA; on CUDA the captured graph replays the steps too."""
from __future__ import annotations

import pytest
import torch

from specserve import ConfigError
from specserve.config import EngineConfig
from specserve.engine.cuda_graph import GraphRunner, StepInputs, chunk_pair_slots
from specserve.layers.attention import TritonBackend, new_token_slots
from specserve.layers.triton_attention import build_triton_metadata
from specserve.models import load_model

from .conftest import DEVICE, kernel_marks, make_hf_checkpoint

needs_kernels, _ = kernel_marks()
PAGE, AUX = 16, (1, 2)
TABLES = [[0, 1], [2], [3, 4, 5, 6, 7]]  # three sequences' blocks


def step_of(ids: list[list[int]], starts: list[int], samples: list[bool]) -> StepInputs:
    """A step computing ids[i] at positions starts[i].. of sequence i; rows that sample take their last token."""
    flat, positions, logit_index = [], [], []
    for seq_ids, start, sample in zip(ids, starts, samples):
        flat += seq_ids
        positions += range(start, start + len(seq_ids))
        if sample:
            logit_index.append(len(flat) - 1)
    q_lens = [len(x) for x in ids]
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    return StepInputs(flat, positions, q_lens, seq_lens, TABLES[:len(ids)], [None] * len(ids), logit_index,
                      list(range(len(ids))))


def ancestors(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i sees node j when j is i or an ancestor of i (`DraftTree.ancestor_mask`)."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i in range(1, len(parents)):
        mask[i] |= mask[parents[i]]
    return mask


def eager(model, step: StepInputs, cache: torch.Tensor, group: int, dev: torch.device):
    trees = step.trees if any(t is not None for t in step.trees) else None
    meta = build_triton_metadata(step.q_lens, step.seq_lens, step.block_tables, PAGE, dev, group, trees, cache)
    ids = torch.tensor(step.ids, device=dev)
    hidden, aux = model(ids, torch.tensor(step.positions, device=dev), meta, AUX)
    return model.compute_logits(hidden[torch.tensor(step.logit_index, dtype=torch.long, device=dev)]).float(), \
        torch.cat(aux, dim=-1)


def model_and_runner(path: str, seed: int, dev: torch.device):
    """A tiny random Llama, its KV cache (16 blocks + the scratch slot) and a GraphRunner with mixed graphs of 32
    and 64 tokens for up to 4 rows (not captured); and the query heads per KV head."""
    model = load_model(make_hf_checkpoint(path, "llama", seed=seed), torch.float32, dev)
    layer = model.attention_layers()[0]
    group = layer.num_heads // layer.num_kv_heads
    scratch = 16 * PAGE
    cache = torch.zeros(len(model.attention_layers()), 2, scratch + 1, layer.num_kv_heads, layer.head_dim,
                        device=dev)
    runner = GraphRunner(model, TritonBackend(), cache, PAGE, 4, 8, [1], AUX, group, scratch, dev,
                         mixed_tokens=(32, 64))
    return model, cache, runner, group


@needs_kernels
def test_mixed_graph_runs_the_eager_step(tmp_path):
    dev = torch.device(DEVICE["name"])
    model, cache, runner, group = model_and_runner(str(tmp_path / "m"), 3, dev)
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(2, 200, (n,), generator=g).tolist()

    with torch.inference_mode():
        eager(model, step_of([tokens(20), tokens(9), tokens(10)], [0, 0, 0], [True, True, False]), cache, group, dev)
        verify = step_of([tokens(4), tokens(1), tokens(12)], [20, 9, 10], [True, True, False])
        verify.logit_index = [0, 1, 2, 3, 4]  # the first row verifies a chain of 3 drafts: its 4 tokens sample,
        tree = step_of([tokens(1), tokens(6), tokens(12)], [20, 9, 10], [True, True, False])
        tree.logit_index = [0, 1, 2, 3, 4, 5, 6]  # the second row verifies a tree of 6 nodes, every node sampling
        tree.trees = [None, ancestors([-1, 0, 0, 1, 1, 2]), None]
        steps = [verify,  # 17 tokens: graph 32; 5 logits rows where the graph computes 4 (max_bs)
                 tree,  # 19 tokens: graph 32, a tree's rows masked by its ancestors beside a prompt chunk
                 step_of([tokens(1), tokens(1), tokens(28)], [20, 9, 10], [True, True, False]),  # 30 tokens: graph 32
                 step_of([tokens(1), tokens(1), tokens(40)], [21, 10, 38], [True, True, True])]  # 42: graph 64
        for step in steps:
            key = runner.graph_for(step)
            assert key == (0, 32 if len(step.ids) <= 32 else 64)
            want_logits, want_aux = eager(model, step, cache, group, dev)
            runner.fill_mixed(key[1], step)
            logits, aux, (ids, positions, slots, pairs_stored) = runner.mixed_outputs(step, *runner._run(*key))
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(aux, want_aux, rtol=1e-4, atol=1e-4)
            assert ids.tolist() == step.ids and positions.tolist() == step.positions and not pairs_stored  # no follower
            assert slots.tolist() == new_token_slots(step.q_lens, step.seq_lens, step.block_tables, PAGE)


def test_steps_a_mixed_graph_takes():
    """A chain's or a tree's verify rows (every token sampling) beside a prompt take a mixed graph; more rows
    than the graphs hold or too many tokens run eagerly."""
    runner = GraphRunner.__new__(GraphRunner)
    runner.sizes, runner.mixed_tokens, runner.max_bs = {1: [1, 2, 4]}, (32, 64), 4
    assert runner.graph_for(step_of([[5], [6]], [3, 4], [True, True])) == (2, 1)  # decode: a uniform graph
    assert runner.graph_for(step_of([[5], [6] * 10], [3, 0], [True, True])) == (0, 32)
    assert runner.graph_for(step_of([[5] * 65], [0], [True])) is None
    drafted = step_of([[5], [6] * 3], [3, 7], [True, True])
    drafted.logit_index = [0, 1, 2, 3]  # the second row verifies 3 tokens
    assert runner.graph_for(drafted) == (0, 32)
    drafted = step_of([[5], [6] * 4], [3, 7], [True, True])
    drafted.logit_index = [0, 1, 2, 3, 4]  # 5 logits rows: more than the 4 the graph computes (taken after it)
    assert runner.graph_for(drafted) == (0, 32)
    tree = step_of([[5], [6] * 10], [3, 0], [True, True])
    tree.trees = [None, ancestors([-1, 0, 0, 1, 1, 2, 3, 3, 4, 5])]
    tree.logit_index = list(range(11))
    assert runner.graph_for(tree) == (0, 32)
    assert runner.graph_for(step_of([[5]] * 5, [1] * 5, [True] * 5)) is None  # more rows than the graphs hold


def test_chunk_pair_slots_pair_the_tokens_of_each_prompt_chunk():
    """A decode token, a chunk of 3 that samples nothing (mid-prompt), a verified chain of 3 (every token samples)
    and a chunk of 2 sampling its last: pairs (token r, token r + 1) within the chunks only, in r + 1's slot."""
    step = StepInputs(list(range(9)), list(range(9)), [1, 3, 3, 2], [5, 3, 8, 2], [[0]] * 4, [None] * 4,
                      [0, 4, 5, 6, 8], [0, 1, 2, 3])
    slots = [10, 20, 21, 22, 30, 31, 32, 40, 41]
    assert chunk_pair_slots(step, slots, 99) == [99, 21, 22, 99, 99, 99, 99, 41, 99]


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="CUDA graphs")
def test_mixed_graph_replays_the_eager_step(tmp_path):
    dev = torch.device("cuda")
    model, cache, runner, group = model_and_runner(str(tmp_path / "m"), 4, dev)
    runner.capture()
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        eager(model, step_of([torch.randint(2, 200, (n,), generator=g).tolist() for n in (20, 9, 10)], [0, 0, 0],
                             [True, True, False]), cache, group, dev)
        for starts, sizes in (([20, 9, 10], (4, 1, 12)), ([20, 9, 10], (1, 6, 12)), ([20, 9, 10], (1, 1, 28)),
                              ([21, 10, 38], (1, 1, 40))):
            step = step_of([torch.randint(2, 200, (n,), generator=g).tolist() for n in sizes], starts,
                           [True, True, True])
            if sizes[0] == 4:  # the first row verifies a chain: 6 logits rows where the graph computes 4
                step.logit_index = [0, 1, 2, 3, 4, 16]
            if sizes[1] == 6:  # the second row verifies a tree of 6 nodes beside a prompt chunk
                step.logit_index = [0, 1, 2, 3, 4, 5, 6, 18]
                step.trees = [None, ancestors([-1, 0, 0, 1, 1, 2]), None]
            want_logits, want_aux = eager(model, step, cache, group, dev)
            logits, aux, _ = runner.replay(runner.graph_for(step), step)
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(aux, want_aux, rtol=1e-4, atol=1e-4)
    assert runner.mixed_replays == 4


def test_cuda_graph_max_tokens_is_checked():
    with pytest.raises(ConfigError, match="cuda_graph_max_tokens must be >= 0, got -1"):
        EngineConfig.from_options(cuda_graph_max_tokens=-1)
    assert EngineConfig.from_options(cuda_graph_max_tokens=0).execution.cuda_graph_max_tokens == 0
