"""Shared fixtures: tiny random Hugging Face checkpoints made with transformers (the parity oracle)."""
from __future__ import annotations

import os
import random

import pytest
import torch

ARCHS = ("llama", "qwen2", "qwen3")
DEVICE = {"name": "cpu"}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: a test-time switch only
COMPILE_ONLY = {"report": None}  # --compile-for-hopper: kernel launches compile for sm_90 here, nothing runs
COMPILE_CHECK = {"run": None}  # test_triton_compile's children (hopper_compile.CompileRun), started at collection
CHECK_TEST = "test_every_triton_kernel_compiles_for_hopper"


def kernel_marks() -> tuple:
    """(needs_kernels, needs_cuda) skip marks for Triton kernel tests: the kernels run on CUDA (--device cuda)
    or on CPU under Triton's interpreter (or, with --compile-for-hopper, are only compiled); some tests need them
    compiled for CUDA. Call at module import (after pytest_configure has read --device)."""
    from specserve.layers.triton_ops import triton

    runs = DEVICE["name"] == "cuda" or INTERPRET or COMPILE_ONLY["report"] is not None
    kernels = pytest.mark.skipif(triton is None or not runs,
                                 reason="Triton kernels run on CUDA (--device cuda), under TRITON_INTERPRET=1 or "
                                 "--compile-for-hopper")
    compiled = DEVICE["name"] == "cuda" and not INTERPRET or COMPILE_ONLY["report"] is not None
    cuda = pytest.mark.skipif(triton is None or not compiled,
                              reason="compiled for CUDA only (--device cuda, no TRITON_INTERPRET)")
    return kernels, cuda


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="device the engine runs on in tests (the transformers oracle stays on CPU, fp32)")
    parser.addoption("--compile-for-hopper", metavar="REPORT", default=None,
                     help="on a CPU: compile every Triton kernel launch for sm_90 instead of running it, and write "
                     "each kernel's compiles and failures to REPORT (JSON; tests/hopper_compile.py). No output is "
                     "computed: run it with python -O and --assert=plain to switch the tests' checks off; "
                     "test_triton_compile reads REPORT")
    parser.addoption("--compile-shard", metavar="I/N", default=None,
                     help="with --compile-for-hopper: run only the I-th of N shares of the tests (dealt case by case "
                     "in turn), so N processes can compile side by side")


def pytest_configure(config):
    DEVICE["name"] = config.getoption("--device")
    report = config.getoption("--compile-for-hopper")
    if report is not None and DEVICE["name"] == "cpu" and not INTERPRET:
        from .hopper_compile import install

        install(report)
        COMPILE_ONLY["report"] = report


def compile_check_runs() -> bool:
    """Whether test_triton_compile compiles the kernels for Hopper in this run: on a CPU with Triton installed,
    outside the interpreter and outside its own children (on CUDA the kernel tests compile and run them)."""
    from specserve.layers.triton_ops import triton

    return triton is not None and DEVICE["name"] == "cpu" and not INTERPRET and COMPILE_ONLY["report"] is None


def pytest_collection_finish(session):
    if (compile_check_runs() and not session.config.option.collectonly
            and any(item.name == CHECK_TEST for item in session.items)):
        from .hopper_compile import CompileRun

        COMPILE_CHECK["run"] = CompileRun()


def pytest_sessionfinish(session, exitstatus):
    if COMPILE_CHECK["run"] is not None:
        COMPILE_CHECK["run"].close()
        COMPILE_CHECK["run"] = None


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--compile-shard")
    if shard is None:
        return
    index, count = (int(part) for part in shard.split("/"))
    keep, drop = [], []
    for turn, item in enumerate(items):
        (keep if turn % count == index else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def skip_without_ranks(options: dict) -> None:
    """Skip a test whose engine options ask for more tensor-parallel ranks than the device under test has GPUs."""
    ranks = options.get("tensor_parallel_size", 1)
    if DEVICE["name"] == "cuda" and torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} tensor-parallel ranks need {ranks} GPUs")


def make_llm(model: str, **options):
    """An LLM on the device under test, computing in fp32 so it can match the fp32 oracle."""
    from specserve import LLM

    options.setdefault("device", DEVICE["name"])
    options.setdefault("dtype", "float32")
    return LLM(model, **options)


def engine_options(**options) -> dict:
    options.setdefault("device", DEVICE["name"])
    options.setdefault("dtype", "float32")
    return options


def make_hf_checkpoint(path: str, arch: str, seed: int = 0, vocab: int = 256, layers: int = 3,
                       tie: bool = False, rope_scaling: dict | None = None, kv_heads: int = 2) -> str:
    """Save a tiny random transformers model of the given family to `path`; return path."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, eos_token_id=1, bos_token_id=0,
                  initializer_range=0.25)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_scaling=rope_scaling) if rope_scaling else tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=24), tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # make biases and norms non-trivial so the test can see them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers, one prompt at a time (no padding to blur the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def mixed_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{arch: checkpoint folder} for every supported family."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_checkpoint(str(root / arch), arch, seed=i) for i, arch in enumerate(ARCHS)}


def assert_pool_full(llm) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    assert all(c == 0 for c in engine.blocks.ref_counts)
    engine.blocks.check()  # prefix cache and host pool agree with the pool


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
