#!/usr/bin/env python3
"""Build specserve's default target model: a small Llama trained from scratch on the
CPython standard library of the running interpreter, and with --packages on the code of the packages
`scripts/pair_data.py packages` fetched (its training packages join the training set; its held-out
packages are evaluated on, never trained on).

Only torch, transformers, tokenizers and safetensors are used; nothing is downloaded.
See scripts/README_train.md for usage.
"""
import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import textwrap
import time

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  "<think>", "</think>", "<tool_call>", "</tool_call>"]
# Like Qwen2.5: the tag tokens are added tokens but not "special", so they survive
# decode(skip_special_tokens=True) and tool calls / thoughts stay visible in text.
NON_SPECIAL_TAGS = {"<think>", "</think>", "<tool_call>", "</tool_call>"}
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}\n"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- elif messages[0]['role'] == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}\n"
    "{%- for tool_call in message.tool_calls %}\n"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}\n"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--out", required=True, help="output directory (model + tokenizer + reports)")
    a("--stdlib", default=None, help="stdlib folder to train on (default: this Python's)")
    a("--packages", default=None, help="the folder `scripts/pair_data.py packages` wrote (manifest.json, "
      "train/, heldout/): more training code, and held-out packages to evaluate on")
    a("--vocab-size", type=int, default=4096)
    a("--hidden-size", type=int, default=192)
    a("--num-hidden-layers", type=int, default=12)
    a("--num-attention-heads", type=int, default=6)
    a("--num-key-value-heads", type=int, default=2)
    a("--intermediate-size", type=int, default=512)
    a("--rope-theta", type=float, default=10000.0)
    a("--max-position-embeddings", type=int, default=2048)
    a("--rms-norm-eps", type=float, default=1e-5)
    a("--no-tie-word-embeddings", dest="tie_word_embeddings", action="store_false")
    a("--seq-len", type=int, default=512)
    a("--batch-size", type=int, default=16)
    a("--steps", type=int, default=1000)
    a("--lr", type=float, default=3e-3)
    a("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --lr")
    a("--warmup-steps", type=int, default=200, help="capped at 10%% of --steps")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0)
    a("--chat-frac", type=float, default=0.05, help="fraction of train files also added as chat samples")
    a("--seed", type=int, default=0)
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    a("--compile", action="store_true", help="torch.compile the training forward (CUDA only)")
    a("--log-every", type=int, default=50)
    a("--eval-every", type=int, default=500, help="periodic held-out eval (0 = only at the end)")
    a("--eval-windows", type=int, default=256, help="held-out windows per evaluation")
    a("--eval-ast", type=int, default=50, help="held-out function headers for the ast parse check")
    a("--max-minutes", type=float, default=0.0,
      help="stop training once this much wall time since start has passed (0 = no limit)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- corpus
def is_heldout(rel):
    """Deterministic ~1/8 held-out split: SHA-1 of the relative path ends in '0' or '1'."""
    return hashlib.sha1(rel.encode("utf-8")).hexdigest()[-1] in "01"


STDLIB_SOURCE = "SOURCE.json"  # written beside a copied stdlib by `scripts/pair_data.py stdlib`


def stdlib_source(root):
    """(python_version, stdlib path) the stdlib under root came from: its SOURCE.json when it is a copy,
    else this Python's."""
    marker = os.path.join(root, STDLIB_SOURCE)
    if os.path.isfile(marker):
        with open(marker) as f:
            source = json.load(f)
        return source["python_version"], source["stdlib_path"]
    return platform.python_version(), root


def find_stdlib_files(root=None):
    """Sorted (relative posix path, absolute path) of non-test stdlib .py files."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for fn in filenames:
            if fn.endswith(".py") and not fn.startswith("test_"):
                full = os.path.join(dirpath, fn)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return root, sorted(found)


def package_files(root, split):
    """Sorted (NAME/relative posix path, absolute path) of the .py files under root/split/ (the packages step's
    output; the step already left out tests and vendored copies)."""
    base = os.path.join(root, split)
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for fn in filenames:
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                found.append((os.path.relpath(full, base).replace(os.sep, "/"), full))
    return sorted(found)


def read_docs(files):
    """(rel, text) of the non-blank files, each text once (the first path that has it)."""
    docs, seen = [], set()
    for rel, full in files:
        with open(full, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if text.strip() and digest not in seen:
            seen.add(digest)
            docs.append((rel, text))
    return docs


def load_corpus(root=None, packages=None):
    """Return stdlib root, train docs, held-out stdlib docs and held-out package docs as lists of (relpath, text);
    package docs are named `pkg:NAME/path`. A text already seen (in the stdlib or another package) is kept once."""
    root, files = find_stdlib_files(root)
    docs = read_docs(files)
    train = [(rel, text) for rel, text in docs if not is_heldout(rel)]
    held = [(rel, text) for rel, text in docs if is_heldout(rel)]
    held_packages = []
    if packages:
        seen = {hashlib.sha1(t.encode("utf-8")).hexdigest() for _, t in docs}
        for split, into in (("train", train), ("heldout", held_packages)):
            for rel, text in read_docs(package_files(packages, split)):
                digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
                if digest not in seen:
                    seen.add(digest)
                    into.append((f"pkg:{rel}", text))
    return root, train, held, held_packages


def package_manifest(packages):
    """The packages step's manifest entries (name, version, licence, split, files, bytes), or []."""
    if not packages:
        return []
    with open(os.path.join(packages, "manifest.json")) as f:
        return [{k: p[k] for k in ("name", "version", "licence", "split", "files", "bytes")}
                for p in json.load(f)["packages"]]


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, vocab_size):
    """Byte-level BPE with SPECIAL_TOKENS at ids 0..6."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        t["special"] = t["content"] not in NON_SPECIAL_TAGS
    tok = Tokenizer.from_str(json.dumps(spec))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def save_tokenizer(tok, out, model_max_length):
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
           "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
           "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
           "model_max_length": model_max_length, "add_bos_token": False, "add_prefix_space": False,
           "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def chat_text(user, assistant):
    """One user/assistant exchange, byte-identical to CHAT_TEMPLATE's rendering."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def chat_prompt(rel):
    return f"Write Python code from Lib/{rel}"


def verify_tokenizer(out, samples):
    """Reload through transformers; check chat template and exact round trips."""
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.eos_token_id == 0 and hf.pad_token_id == 0 and hf.bos_token_id is None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x = 1"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == chat_text("hi", "x = 1")
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two ints",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    with_tools = hf.apply_chat_template(msgs[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in with_tools and '"name": "add"' in with_tools
    assert with_tools.endswith("<|im_start|>assistant\n")
    for s in samples:
        ids = hf.encode(s, add_special_tokens=False, verbose=False)
        assert hf.decode(ids) == s, "tokenizer round trip failed"
    return hf


# ----------------------------------------------------------------------------- data
def build_stream(tok, docs, chat_frac, seed, chat_chars):
    """Token stream: each doc + <|endoftext|>; a chat_frac of docs also appear as a chat sample."""
    rng = random.Random(seed)
    texts = []
    for rel, text in docs:
        texts.append(text)
        if rng.random() < chat_frac:
            cut = text[:chat_chars]
            cut = cut[: cut.rfind("\n") + 1] or cut
            texts.append(chat_text(chat_prompt(rel), cut))
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long), len(texts) - len(docs)


def sample_batch(data, batch_size, seq_len, gen, device):
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = data[(starts[:, None] + torch.arange(seq_len + 1)).to(device)]
    return x[:, :-1], x[:, 1:]


# ----------------------------------------------------------------------------- model
def build_model(args):
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        head_dim=args.hidden_size // args.num_attention_heads, intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.rms_norm_eps,
        rope_theta=args.rope_theta, tie_word_embeddings=args.tie_word_embeddings,
        bos_token_id=None, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def make_optimizer(model, args, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(progress, step, warmup, args):
    """Linear warmup, then cosine to min_lr_ratio * lr over progress in [0, 1]."""
    if step < warmup:
        return args.lr * (step + 1) / warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lm_loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def evaluate(model, data, args, device):
    """Held-out perplexity over evenly spaced (deterministic) windows."""
    model.eval()
    n = max(1, min(args.eval_windows, (len(data) - 1) // args.seq_len))
    starts = torch.linspace(0, len(data) - args.seq_len - 1, n).long()
    total, count = 0.0, 0
    for i in range(0, n, args.batch_size):
        x = data[(starts[i:i + args.batch_size, None] + torch.arange(args.seq_len + 1)).to(device)]
        with autocast(device):
            total += lm_loss(model, x[:, :-1], x[:, 1:]).item() * x.size(0)
        count += x.size(0)
    model.train()
    return math.exp(total / count)


def train(model, data, held, args, device, t_start):
    """Training loop; returns a summary dict. The LR schedule follows whichever of steps or
    the --max-minutes budget runs out first, so the model is annealed either way."""
    opt = make_optimizer(model, args, device)
    step_fn = torch.compile(model) if args.compile and device.type == "cuda" else model
    gen = torch.Generator().manual_seed(args.seed)
    warmup = max(1, min(args.warmup_steps, args.steps // 10))
    budget = args.max_minutes * 60 - (time.time() - t_start) if args.max_minutes > 0 else float("inf")
    log(f"training: {args.steps} steps, warmup {warmup}, time budget {budget:.0f}s")
    t0 = t_log = time.time()
    losses, recent, evals, stopped_by_time, step = [], [], [], False, 0
    model.train()
    while step < args.steps:
        elapsed = time.time() - t0
        if elapsed > budget:
            stopped_by_time = True
            log(f"time budget reached after {step} steps")
            break
        lr = lr_at(max(step / args.steps, elapsed / budget), step, warmup, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sample_batch(data, args.batch_size, args.seq_len, gen, device)
        with autocast(device):
            loss = lm_loss(step_fn, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        recent.append(loss.detach())
        if step % args.log_every == 0 or step == args.steps:
            avg = torch.stack(recent).mean().item()
            losses.append(avg)
            now = time.time()
            tps = len(recent) * args.batch_size * args.seq_len / (now - t_log)
            log(f"step {step}/{args.steps} loss {avg:.4f} lr {lr:.2e} tok/s {tps:,.0f} elapsed {now - t0:.0f}s")
            recent, t_log = [], now
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            t_eval = time.time()
            evals.append({"step": step, "heldout_ppl": evaluate(model, held, args, device)})
            log(f"eval step {step} held-out ppl {evals[-1]['heldout_ppl']:.3f}")
            t_log += time.time() - t_eval  # keep eval time out of tok/s
    if recent:
        losses.append(torch.stack(recent).mean().item())
    train_s = time.time() - t0
    return {"steps_done": step, "warmup_steps": warmup, "stopped_by_time": stopped_by_time,
            "final_train_loss": losses[-1] if losses else None, "train_seconds": round(train_s, 1),
            "tokens_seen": step * args.batch_size * args.seq_len,
            "tokens_per_s": round(step * args.batch_size * args.seq_len / max(train_s, 1e-9)),
            "eval_history": evals}


# ----------------------------------------------------------------------------- ast sanity eval
def function_headers(held, n):
    """n evenly spaced (prefix, def_source, indent, lead) from held-out top-level / class-level defs.

    The prefix ends inside the indentation of the next body line, one space short (`lead`): the
    pre-tokenizer gives an indentation's last space to the following word ("\n   " + " return"), so a
    prompt ending at a newline would ask the model for a token boundary it never saw in training."""
    cands = []
    for rel, text in held:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        nodes = tree.body + [c for nd in tree.body if isinstance(nd, ast.ClassDef) for c in nd.body]
        for nd in nodes:
            if not isinstance(nd, ast.FunctionDef) or not lines[nd.lineno - 1].lstrip().startswith("def "):
                continue
            body = nd.body
            has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str)
            if body[0].lineno == nd.lineno or (has_doc and len(body) < 2):
                continue  # one-liners and docstring-only functions say nothing
            end = body[0].end_lineno if has_doc else body[0].lineno - 1
            first = body[1] if has_doc else body[0]
            lead = " " * max(0, first.col_offset - 1)
            cands.append(("".join(lines[:end]) + lead, "".join(lines[nd.lineno - 1:end]), nd.col_offset, lead))
    if not cands:
        return []
    n = min(n, len(cands))
    return [cands[i * len(cands) // n] for i in range(n)]


def cut_completion(text, indent, truncated):
    """Keep completion lines until the first non-blank line indented <= indent."""
    lines = text.split("\n")
    kept, dedented = [], False
    for ln in lines:
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent:
            dedented = True
            break
        kept.append(ln)
    if truncated and not dedented and len(kept) > 1:
        kept = kept[:-1]  # drop the half-written last line of a length-capped generation
    return "\n".join(kept).rstrip() + "\n"


@torch.no_grad()
def ast_eval(model, tok, held, args, device, max_prompt=384, max_new=128, batch=16):
    """Greedy-complete held-out function headers; rate at which def + body parses."""
    items = function_headers(held, args.eval_ast)
    model.eval()
    ok, examples = 0, []
    for i in range(0, len(items), batch):
        chunk = items[i:i + batch]
        prompts = [tok.encode(p, add_special_tokens=False).ids[-max_prompt:] for p, _, _, _ in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with autocast(device):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=0, pad_token_id=0)
        for (prefix, header, indent, lead), row in zip(chunk, out[:, width:].tolist()):
            truncated = 0 not in row
            row = row[:row.index(0)] if 0 in row else row
            body = cut_completion(lead + tok.decode(row, skip_special_tokens=True), indent, truncated)
            good = bool(body.strip())
            try:
                ast.parse(textwrap.dedent(header + body))
            except (SyntaxError, ValueError):
                good = False
            ok += good
            if len(examples) < 3:
                examples.append({"header": header, "completion": body, "parses": good})
    return {"n": len(items), "parsed": ok, "parse_rate": ok / max(1, len(items)), "examples": examples}


# ----------------------------------------------------------------------------- main
def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.num_key_value_heads:
        sys.exit(f"need hidden_size ({args.hidden_size}) % num_attention_heads ({args.num_attention_heads}) == 0 "
                 f"and num_attention_heads % num_key_value_heads ({args.num_key_value_heads}) == 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        torch.cuda.manual_seed_all(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)

    root, train_docs, held_docs, held_pkg_docs = load_corpus(args.stdlib, args.packages)
    log(f"stdlib {root}: {len(train_docs)} train files, {len(held_docs)} held-out files"
        + (f", {len(held_pkg_docs)} held-out package files" if args.packages else ""))
    tok = train_tokenizer((t for _, t in train_docs), args.vocab_size)
    save_tokenizer(tok, args.out, args.max_position_embeddings)
    verify_tokenizer(args.out, [t for _, t in held_docs[:20]] + ["s = 'h\u00e9llo \u2713 \u65e5'\r\n\t x\n\n"])
    log(f"tokenizer: vocab {tok.get_vocab_size()} ({time.time() - t_start:.1f}s)")

    train_data, n_chat = build_stream(tok, train_docs, args.chat_frac, args.seed, chat_chars=3 * args.seq_len)
    held_data, _ = build_stream(tok, held_docs, 0.0, args.seed, 0)
    held_pkg_data = build_stream(tok, held_pkg_docs, 0.0, args.seed, 0)[0] if held_pkg_docs else None
    python_version, stdlib_path = stdlib_source(root)
    corpus = {"python_version": python_version, "stdlib_path": stdlib_path,
              "train_files": len(train_docs), "heldout_files": len(held_docs), "chat_samples": n_chat,
              "train_tokens": len(train_data), "heldout_tokens": len(held_data),
              "heldout_rule": "sha1(relative posix path).hexdigest()[-1] in '01'",
              "packages": package_manifest(args.packages),
              "heldout_package_files": len(held_pkg_docs),
              "heldout_package_tokens": len(held_pkg_data) if held_pkg_data is not None else 0,
              "heldout_file_list": [rel for rel, _ in held_docs]}
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump(corpus, f, indent=2)
    log(f"tokens: train {len(train_data):,} (incl. {n_chat} chat samples), held-out {len(held_data):,}")

    train_data, held_data = train_data.to(device), held_data.to(device)
    model = build_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters on {device} ({time.time() - t_start:.1f}s)")
    summary = train(model, train_data, held_data, args, device, t_start)
    ppl = evaluate(model, held_data, args, device)
    log(f"final held-out ppl {ppl:.3f} (train loss {summary['final_train_loss']:.4f})")
    pkg_ppl = evaluate(model, held_pkg_data.to(device), args, device) if held_pkg_data is not None else None
    if pkg_ppl is not None:
        log(f"held-out packages ppl {pkg_ppl:.3f}")
    ast_res = ast_eval(model, tok, held_docs, args, device) if args.eval_ast > 0 else None
    if ast_res:
        log(f"ast parse rate {ast_res['parsed']}/{ast_res['n']} = {ast_res['parse_rate']:.2f}")
    ast_pkg = ast_eval(model, tok, held_pkg_docs, args, device) if args.eval_ast > 0 and held_pkg_docs else None
    if ast_pkg:
        log(f"held-out packages ast parse rate {ast_pkg['parsed']}/{ast_pkg['n']} = {ast_pkg['parse_rate']:.2f}")

    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.eos_token_id = [0, 2]  # <|endoftext|>, <|im_end|>
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    model.save_pretrained(args.out)
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        (platform.processor() or platform.machine()) + f" ({os.cpu_count()} cpus)"
    report = {"args": vars(args), "seed": args.seed, "param_count": n_params, "corpus": {
        k: v for k, v in corpus.items() if k != "heldout_file_list"}, **summary,
        "heldout_ppl": ppl, "heldout_loss": math.log(ppl), "ast_eval": ast_res,
        "heldout_packages_ppl": pkg_ppl, "heldout_packages_ast_eval": ast_pkg,
        "wall_seconds": round(time.time() - t_start, 1), "device": str(device), "device_name": device_name,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "python": sys.version.split()[0]}
    with open(os.path.join(args.out, "train_args.json"), "w") as f:
        json.dump(report, f, indent=2)
    log(f"saved to {args.out} in {report['wall_seconds']}s")


if __name__ == "__main__":
    main()
