"""Structured output (issue 20): outputs constrained by random small JSON schemas parse and validate, and
with speculation (chains and trees) they are the tokens plain decoding gives, greedy and seeded; the
tree masks are the masks a fresh matcher gives after each node's path, and drafts never reach the
committed matcher."""
from __future__ import annotations

import json
import random

import pytest
import torch

from specserve import SamplingParams
from specserve.assets import default_draft_path, default_model_path
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.layers.grammar import Grammar, unpack

from .conftest import make_llm

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small object schema whose every value is bounded (so a tiny model finishes it)."""
    kinds = ["integer", "boolean", "string", "enum", "null", "array"] + (["object"] if depth < 1 else [])
    props = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "integer":
            lo = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
        elif kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "x", "yes", "no"], rng.randint(1, 3))}
        elif kind == "array":
            prop = {"type": "array", "items": {"type": "boolean"}, "maxItems": rng.randint(0, 3)}
        elif kind == "object":
            prop = random_schema(rng, depth + 1)
        else:
            prop = {"type": kind}
        props[f"{kind[:3]}{i}"] = prop
    names = list(props)
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names)))}


PROMPTS = ["def load(path):\n    return", "# settings\nCONFIG = ", "import json\n\n", "class A:\n    x = ",
           "print(", "data = json.loads('"]
NUM = 100


@pytest.fixture(scope="module")
def cases():
    rng = random.Random(0)
    out = []
    for i in range(NUM):
        schema = random_schema(rng)
        temp, seed = ((0.0, None), (1.0, 100 + i))[i % 2]
        guided = json.dumps(schema) if i % 3 == 0 else schema  # the JSON text or the dict
        out.append((PROMPTS[i % len(PROMPTS)], schema,
                    SamplingParams(temperature=temp, seed=seed, max_tokens=160, guided_json=guided)))
    return out


@pytest.fixture(scope="module")
def plain(cases):
    llm = make_llm(default_model_path(), speculative_algorithm="none")
    return [o.token_ids for o in llm.generate([p for p, _, _ in cases], [s for _, _, s in cases])]


def test_outputs_parse_and_validate(cases):
    llm = make_llm(default_model_path(), speculative_algorithm="none", disable_overlap_schedule=True)
    outs = llm.generate([p for p, _, _ in cases], [s for _, _, s in cases])
    finished = 0
    for out, (_, schema, _) in zip(outs, cases):
        if out.finish_reason == "length":
            continue
        finished += 1
        jsonschema.validate(json.loads(out.text), schema)
    assert finished >= NUM * 0.9, "most outputs must complete within max_tokens"
    obj = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=160, guided_json_object=True))
    assert all(isinstance(json.loads(o.text), dict) for o in obj if o.finish_reason == "stop")


def test_overlap_changes_nothing(cases, plain):
    llm = make_llm(default_model_path(), speculative_algorithm="none", disable_overlap_schedule=True)
    assert [o.token_ids for o in llm.generate([p for p, _, _ in cases], [s for _, _, s in cases])] == plain


@pytest.mark.parametrize("spec", [dict(speculative_num_steps=3, speculative_eagle_topk=1),
                                  dict(speculative_num_steps=3, speculative_eagle_topk=2,
                                       speculative_num_draft_tokens=6)], ids=["chain3", "tree"])
def test_speculation_keeps_the_tokens(cases, plain, spec):
    llm = make_llm(default_model_path(), speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=default_draft_path(), speculative_policy="always", **spec)
    outs = llm.generate([p for p, _, _ in cases], [s for _, _, s in cases])
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.stats.spec.num_accepted_tokens > NUM


# ---- the masks ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["xy", "z"]}}, "required": ["a", "b"]}


def grammar(tokenizer) -> Grammar:
    return Grammar(SamplingParams(guided_json=SCHEMA), tokenizer, [0])


def mask_after(tokenizer, tokens: list[int]) -> torch.Tensor:
    """A fresh matcher fed tokens: the mask of the next token [W], or all ones when a token is refused."""
    g = grammar(tokenizer)
    bitmask = torch.full((1, g.width), -1, dtype=torch.int32)
    if all(g.accept(t) for t in tokens):
        g.fill(bitmask, 0)
    return bitmask[0]


def test_tree_masks_are_the_masks_after_each_path(tokenizer):
    text = tokenizer.encode('{"a": 42, "b": "xy"}')
    rng = random.Random(1)
    for _ in range(20):
        done = rng.randint(0, len(text) - 4)
        g = grammar(tokenizer)
        assert all(g.accept(t) for t in text[:done])
        n = rng.randint(2, 8)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens = [text[done - 1] if done else 0]
        depth = [0]
        for j in range(1, n):  # mostly the true continuation, sometimes any token (often refused)
            depth.append(depth[parents[j]] + 1)
            at = done + depth[j] - 1
            tokens.append(text[at] if at < len(text) and rng.random() < 0.7 else rng.randrange(4096))
        before = torch.full((1, g.width), -1, dtype=torch.int32)
        g.fill(before, 0)
        bitmask = torch.full((n, g.width), -1, dtype=torch.int32)
        g.fill_tree(bitmask, tokens, parents)
        for j in range(n):
            path, node = [], j
            while node > 0:
                path.insert(0, tokens[node])
                node = parents[node]
            assert torch.equal(bitmask[j], mask_after(tokenizer, text[:done] + path))
        after = torch.full((1, g.width), -1, dtype=torch.int32)
        g.fill(after, 0)
        assert torch.equal(before, after), "the drafts were rolled back"


def test_the_pending_token_is_taken_and_rolled_back(tokenizer):
    text = tokenizer.encode('{"a": 42, "b": "xy"}')
    g = grammar(tokenizer)
    for t in text[:3]:
        g.accept(t)
    bitmask = torch.full((2, g.width), -1, dtype=torch.int32)
    g.fill(bitmask, 1, pending=text[3])
    assert torch.equal(bitmask[1], mask_after(tokenizer, text[:4]))
    g.fill(bitmask, 0)
    assert torch.equal(bitmask[0], mask_after(tokenizer, text[:3]))
    allowed = unpack(bitmask, 4100, "cpu")  # the model's padding past the tokenizer is never allowed
    assert allowed.shape == (2, 4100) and not allowed[:, 4096:].any()
    assert allowed[1, text[4]] and not allowed[0, text[4]] or allowed[0, text[3]]


def test_bad_requests_are_refused(tokenizer, tmp_path):
    detok = IncrementalDetokenizer(tokenizer, [1])
    with pytest.raises(ValueError, match="guided_json"):
        Grammar(SamplingParams(guided_json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
                detok.tokenizer, [0])
    llm = make_llm(default_model_path(), speculative_algorithm="none")
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        llm.engine.add_request([5, 6], SamplingParams(guided_json={"type": "object", "properties": {
            "a": {"$ref": "#/nope"}}}))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(guided_json_object=True, min_tokens=1)
