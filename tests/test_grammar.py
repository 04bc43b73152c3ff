"""Structured output (issue 20): outputs constrained by random small JSON schemas, regexes, choices and EBNF
grammars match them (checked by jsonschema, Python's re and a parser), and with speculation (chains and trees)
they are the tokens plain decoding gives, greedy and seeded; the tree masks are the masks a fresh matcher gives
after each node's path, and drafts never reach the committed matcher."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from specserve import SamplingParams, StructuredOutputsParams
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
NUM = 100  # JSON schemas; the regexes, choices and grammars below come on top

# (regex, the same in Python's dialect)
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)", r"\d{4}-\d{2}-\d{2}",
           r"(def|class) [a-z_]{1,10}\((x|y)?\):", r"0x[0-9a-f]{1,6}", r"[A-Z][a-z]{0,6}( [a-z]{1,5}){0,3}\."]
CHOICES = [["red", "green", "blue"], ["True", "False"], ["import os", "import sys", "pass"],
           ['say "hi"', "back\\slash", "tab\there", "caf\u00e9"]]
# (grammar, its language's check): key=value pairs, and nested lists of digits at most two long
PAIRS = (r"""root ::= pair ("," pair)? ("," pair)?
pair ::= key "=" value
key ::= [a-z] [a-z]? [a-z]?
value ::= [0-9] [0-9]? | "true" | "false"
""", lambda text: re.fullmatch(r"[a-z]{1,3}=([0-9]{1,2}|true|false)(,[a-z]{1,3}=([0-9]{1,2}|true|false)){0,2}",
                               text) is not None)
LISTS = ("""root ::= "[" items? "]"
items ::= item ("," item)?
item ::= [0-9] | "[" items? "]"
""", lambda text: _short_lists(json.loads(text)))


def _short_lists(value) -> bool:
    return isinstance(value, list) and len(value) <= 2 and all(
        isinstance(v, int) and 0 <= v <= 9 or _short_lists(v) for v in value)


def constraints() -> list[tuple[StructuredOutputsParams, object]]:
    """(constraint, a check of a complete output) for every regex, choice and grammar."""
    out = [(StructuredOutputsParams(regex=r), lambda t, r=r: re.fullmatch(r, t) is not None) for r in REGEXES]
    out += [(StructuredOutputsParams(choice=c), lambda t, c=c: t in c) for c in CHOICES]
    return out + [(StructuredOutputsParams(grammar=g), check) for g, check in (PAIRS, LISTS)]


@pytest.fixture(scope="module")
def cases():
    """(prompt, check of a complete output, params): JSON schemas, then the other constraints twice (greedy and
    seeded)."""
    rng = random.Random(0)
    out = []
    for i in range(NUM):
        schema = random_schema(rng)
        temp, seed = ((0.0, None), (1.0, 100 + i))[i % 2]
        guided = json.dumps(schema) if i % 3 == 0 else schema  # the JSON text or the dict
        out.append((PROMPTS[i % len(PROMPTS)], lambda t, schema=schema: jsonschema.validate(json.loads(t), schema)
                    is None, SamplingParams(temperature=temp, seed=seed, max_tokens=160,
                                            structured_outputs=StructuredOutputsParams(json=guided))))
    for i, (constraint, check) in enumerate(constraints() * 2):
        temp, seed = ((0.0, None), (1.0, 300 + i))[i % 2]
        out.append((PROMPTS[i % len(PROMPTS)], check, SamplingParams(temperature=temp, seed=seed, max_tokens=64,
                                                                     structured_outputs=constraint)))
    return out


@pytest.fixture(scope="module")
def plain(cases):
    llm = make_llm(default_model_path(), speculative_algorithm="none")
    return [o.token_ids for o in llm.generate([p for p, _, _ in cases], [s for _, _, s in cases])]


def test_outputs_parse_and_validate(cases):
    llm = make_llm(default_model_path(), speculative_algorithm="none", disable_overlap_schedule=True)
    outs = llm.generate([p for p, _, _ in cases], [s for _, _, s in cases])
    finished = 0
    for out, (_, check, params) in zip(outs, cases):
        if out.finish_reason == "length":
            continue
        finished += 1
        assert check(out.text), (params.structured_outputs, out.text)
    assert finished >= len(cases) * 0.9, "most outputs must complete within max_tokens"
    kinds = {params.structured_outputs.kind for (_, _, params), out in zip(cases, outs) if out.finish_reason == "stop"}
    assert kinds == {"json", "regex", "choice", "grammar"}
    obj = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=160,
                                                   structured_outputs=StructuredOutputsParams(json_object=True)))
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
    return Grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA)), tokenizer, [0])


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


BAD = [(dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "structured_outputs.json"),
       (dict(regex="(ab"), "structured_outputs.regex: .*parenthesis"),
       (dict(grammar="root ::= foo"), "structured_outputs.grammar: .*foo"),
       (dict(grammar='start ::= "a"'), "structured_outputs.grammar: .*root")]


@pytest.mark.parametrize("spec, says", BAD, ids=["schema", "regex", "grammar", "no-root"])
def test_unusable_constraints_are_refused(tokenizer, spec, says):
    detok = IncrementalDetokenizer(tokenizer, [1])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=says):
        Grammar(params, detok.tokenizer, [0])


def test_bad_requests_are_refused():
    llm = make_llm(default_model_path(), speculative_algorithm="none")
    for spec, _ in BAD:
        with pytest.raises(ValueError, match="invalid sampling parameter"):
            llm.engine.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True), min_tokens=1)
    for spec, says in [({}, "exactly one of .*got none"), (dict(regex="a", choice=["a"]), "got regex, choice"),
                       (dict(choice=[]), "choice must be a list of non-empty strings"),
                       (dict(choice=["a", ""]), "non-empty strings"), (dict(regex=""), "regex must be a non-empty"),
                       (dict(json="{nope"), "json is not valid JSON"), (dict(json=[1]), "JSON schema \\(an object\\)")]:
        with pytest.raises(ValueError, match=says):
            SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
