"""`specserve train-draft`: TTT trains the inference draft module; its output loads and speculates losslessly."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specserve import SamplingParams

from .conftest import make_hf_checkpoint, make_llm

TEXT = "The draft head reads the target features and predicts the next token. " * 12
ARGS = ["--batch-size", "4", "--seq-len", "32", "--ttt-steps", "3", "--lr", "1e-2", "--device", "cpu",
        "--no-progress", "--draft-vocab-size", "256", "--self-distill", "4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from specserve.assets import default_model_path

    root = tmp_path_factory.mktemp("train")
    src = default_model_path()
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    target = make_hf_checkpoint(str(root / "target"), "llama", seed=3, vocab=vocab, layers=4)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), target)
    data = root / "data.txt"
    data.write_text(TEXT)
    return root, target, str(data)


def _log(out):
    return [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]


def test_train_then_speculate(setup):
    from specserve.cli import main
    from specserve.train.data import pack_rows

    root, target, data = setup
    out = str(root / "draft")
    assert main(["train-draft", "--target", target, "--data", data, "--out", out, "--steps", "40",
                 "--save-every", "20", *ARGS]) == 0
    log = _log(out)
    assert [m["step"] for m in log] == list(range(1, 41))
    first, last = sum(m["loss"] for m in log[:5]) / 5, sum(m["loss"] for m in log[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert sum(m["acc"][0] for m in log[-5:]) / 5 > 0.2  # chance is 1/256
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # inputs of layers 2, 2, 1
    from safetensors.torch import load_file

    t = load_file(os.path.join(out, "model.safetensors"))
    assert t["midlayer.self_attn.k_proj.weight"].shape == (32, 128) and t["t2d"].sum() == 256
    assert torch.equal(torch.arange(256) + t["d2t"], t["t2d"].nonzero().squeeze(-1))

    # prompts from the data (self-distilled: the draft saw the target continue them)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(target).encode(TEXT, add_special_tokens=False)
    prompts = pack_rows([ids], 32, None)[:4, :4].tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in make_llm(target).generate(prompts, params)]
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=out,
                   speculative_num_steps=3, speculative_eagle_topk=1, speculative_policy="always")
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats.spec.mean_acceptance_length > 1.5


def test_resume(setup):
    from specserve.cli import main

    root, target, data = setup
    out = str(root / "resume")
    base = ["train-draft", "--target", target, "--data", data, "--out", out, "--save-every", "3", *ARGS]
    assert main(base + ["--steps", "3"]) == 0
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"] == 3
    assert main(base + ["--steps", "5", "--resume"]) == 0
    assert [m["step"] for m in _log(out)] == [1, 2, 3, 4, 5]
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"] == 5


def test_aux_layer_ids_choose_the_features_up_to_the_last_layer(setup, capsys):
    """--aux-layer-ids picks the target layers the draft reads, the last layer's output included; the
    checkpoint records them, speculation with it stays lossless, and ids outside the target are refused."""
    from specserve.cli import main

    root, target, data = setup
    out = str(root / "aux")
    assert main(["train-draft", "--target", target, "--data", data, "--out", out, "--steps", "30",
                 "--aux-layer-ids", "0", "2", "3", *ARGS]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in make_llm(target).generate(prompts, params)]
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=out,
                   speculative_num_steps=3, speculative_eagle_topk=1, speculative_policy="always")
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert main(["train-draft", "--target", target, "--data", data, "--out", str(root / "bad"), "--steps", "1",
                 "--aux-layer-ids", "0", "2", "4", *ARGS]) != 0
    assert "aux layer ids [0, 2, 4]: three layers of 0..3" in capsys.readouterr().err


def test_ttt_matches_inference_and_grads_flow(setup):
    """Step 0 of the unroll is the draft run causally over the row; the cache writes keep the graph, so a
    later step's loss reaches the keys cached at earlier steps."""
    from specserve.models import ArchConfig, load_model, read_config
    from specserve.train.eagle3 import TrainOptions, draft_config, new_draft, row_metadata, target_outputs, ttt_loss

    _, target, _ = setup
    arch = ArchConfig.from_dict(read_config(target))
    model = load_model(target, torch.float32, torch.device("cpu"))
    c = draft_config(arch, arch.vocab_size, TrainOptions(target, [], ""))
    draft = new_draft(c, model.model.embed_tokens, torch.device("cpu"), 0)
    ids = torch.randint(0, arch.vocab_size, (2, 8))
    feats, logits = target_outputs(model, ids, c.target_aux_layers(arch.num_layers))
    t2d = torch.ones(arch.vocab_size, dtype=torch.bool)
    # reference step 0: a plain causal prefill of pairs (f_j, token j+1), j < 7
    attn = draft.attention_layers()[0]
    cache = torch.zeros(1, 2, 2 * 7, attn.num_kv_heads, attn.head_dim)
    with torch.no_grad():
        ref, _ = draft(ids[:, 1:].flatten(), feats[:, :7].reshape(14, -1), torch.arange(7).repeat(2),
                       row_metadata(2, 7, torch.device("cpu"), cache))
    want = -(logits[:, 1:].softmax(-1) * ref.view(2, 7, -1).log_softmax(-1)).sum(-1).mean()
    _, losses, _, _ = ttt_loss(draft, ids, feats, logits, t2d, 1)
    assert losses[0] == pytest.approx(want.item(), rel=1e-5)
    # the scratch cache carries gradients: a later step's output reaches the keys an earlier step wrote
    from specserve.layers.attention import Attention, build_metadata

    att, cache = Attention(2, 1, 4), torch.zeros(1, 2, 8, 1, 4)
    k0 = torch.randn(4, 1, 4, requires_grad=True)
    att(torch.randn(4, 2, 4), k0, torch.randn(4, 1, 4),
        build_metadata([4], [4], [[0]], 8, torch.device("cpu"), kv_cache=cache))
    out = att(torch.randn(4, 2, 4), torch.randn(4, 1, 4), torch.randn(4, 1, 4),
              build_metadata([4], [8], [[0]], 8, torch.device("cpu"), kv_cache=cache))
    (grad,) = torch.autograd.grad(out.sum(), k0)
    assert grad.abs().sum() > 0


def test_learning_rate_schedules_by_worked_example():
    from specserve.train.eagle3 import TrainOptions, learning_rate

    opts = TrainOptions(target="t", data=[], out="o", steps=12, lr=1e-3, lr_schedule="cosine", warmup_steps=1)
    lrs = [learning_rate(opts, s) for s in range(12)]
    assert lrs[0] == pytest.approx(1e-3)  # one warm-up step: (0 + 1) / 1 of lr
    assert lrs[1] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)  # cosine from lr to a tenth
    assert lrs[6] == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway through the cosine: the mean of its ends
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    warm = TrainOptions(target="t", data=[], out="o", steps=100, lr=2e-3, warmup_steps=4)
    assert [learning_rate(warm, s) for s in (0, 1, 3, 4, 99)] == pytest.approx([5e-4, 1e-3, 2e-3, 2e-3, 2e-3])


def test_an_unknown_lr_schedule_is_named(setup):
    from specserve.train.eagle3 import TrainOptions, train

    root, target, data = setup
    with pytest.raises(ValueError, match="lr schedule 'linear'"):
        train(TrainOptions(target=target, data=[data], out=str(root / "bad"), lr_schedule="linear"))
