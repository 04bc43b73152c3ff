"""Tool calls and reasoning through the whole response path: a model that really generates them.

The checkpoint is built by hand: one-hot embeddings, attention and MLP outputs zeroed, and an LM head
that maps each token to a chosen successor, so greedy decoding walks a fixed chain of tokens:
"<think>" reasoning "</think>" "<tool_call>" {json} "</tool_call>" "<|im_end|>". Its tokenizer holds each
of those strings as one token. No part of the engine or server is replaced.
"""
from __future__ import annotations

import json

import pytest
import torch

from specserve.assets import CHAT_TEMPLATE
from specserve.models.checkpoint import save_checkpoint

from .test_server import ServerProcess

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
CHAIN = ["<think>", "The user wants the weather.", "</think>", "<tool_call>", json.dumps(CALL), "</tool_call>",
         "<|im_end|>"]


def make_scripted_model(path: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|im_start|>", "<|im_end|>", "[UNK]", "user", "assistant", "system", "\n", "weather", "Paris"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAIN[:-1] + ["\n"]])
    ids = [tok.token_to_id(t) for t in CHAIN]
    vocab_size, hidden = 64, 64
    succ = {i: ids[0] for i in range(vocab_size)}  # everything leads into the chain...
    succ.update({a: b for a, b in zip(ids, ids[1:])})  # ...which then runs to its end
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": hidden,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False,
              "eos_token_id": tok.token_to_id("<|im_end|>")}
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    head = z(vocab_size, hidden)
    for a, b in succ.items():
        head[b, a] = 1.0
    tensors = {"model.embed_tokens.weight": torch.eye(vocab_size, hidden), "lm_head.weight": head,
               "model.norm.weight": torch.ones(hidden), "model.layers.0.input_layernorm.weight": torch.ones(hidden),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"model.layers.0.self_attn.{name}.weight"] = z(hidden, hidden)
    for name in ("gate_proj", "up_proj"):
        tensors[f"model.layers.0.mlp.{name}.weight"] = z(64, hidden)
    tensors["model.layers.0.mlp.down_proj.weight"] = z(hidden, 64)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                        "pad_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    return save_checkpoint(path, config, tensors, tokenizer=tok, tokenizer_config=tokenizer_config)


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    model = make_scripted_model(str(root / "model"))
    srv = ServerProcess(root / "server.log", "--model", model, "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3", "--speculative-algorithm", "none")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": CITY}}]


def test_tool_call_and_reasoning_non_streamed(scripted_server):
    r = scripted_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather Paris"}], tools=TOOLS, temperature=0,
        max_tokens=20)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    reasoning = getattr(choice.message, "reasoning_content", None) or choice.message.model_extra["reasoning_content"]
    assert reasoning.strip() == "The user wants the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert not (choice.message.content or "").strip()


def test_tool_call_and_reasoning_streamed(scripted_server):
    stream = scripted_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather Paris"}], tools=TOOLS, temperature=0,
        max_tokens=20, stream=True)
    reasoning, names, args, finish = "", [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning.strip() == "The user wants the weather."
    assert names == ["get_weather"] and json.loads(args) == CALL["arguments"]
    assert finish == "tool_calls"
