"""Train an EAGLE-3 draft head against a frozen specserve target with training-time test (TTT).

The draft is `specserve.speculative.eagle3.Eagle3Draft`, the exact module inference runs, its attention
reading and writing a scratch KV cache through `build_metadata` just as the proposer does. Step 0 of the
unroll feeds (fc(target features at j), token j+1) at position j and predicts token j+2; step s > 0 feeds
the draft's own step s-1 output at origin j with token j+1+s at position j+s and predicts token j+2+s.
Each row's draft keys are laid out [step 0 | step 1 | ... | step s], L slots each; a tree mask lets the
query of origin j at step s see step-0 keys of positions <= j (causal) and its own keys of steps 1..s.
Writes into the scratch cache are index assignments, so autograd carries gradients through the cached
keys and values of earlier steps. Loss: soft cross-entropy against the target's distribution restricted
to the draft vocabulary (renormalised), weighted 0.8**s.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from ..layers.attention import build_metadata
from ..models import ArchConfig, load_model, read_config
from ..models.checkpoint import save_checkpoint
from ..speculative.eagle3 import Eagle3Config, Eagle3Draft

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"
LR_SCHEDULES = ("constant", "cosine")
MIN_LR_RATIO = 0.1


@dataclass
class TrainOptions:
    target: str
    data: list[str]
    out: str
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    ttt_steps: int = 7
    lr: float = 5e-4
    lr_schedule: str = "constant"  # or "cosine": from lr down to lr * MIN_LR_RATIO at the last step
    warmup_steps: int = 0  # linear warm-up from 0 to lr over the first steps
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    draft_vocab_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    aux_layer_ids: Optional[tuple[int, ...]] = None  # target layers (0-based) whose outputs the draft reads
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    device: str = "auto"
    resume: bool = False
    seed: int = 0
    self_distill: int = 0  # prompt length of self-distilled rows (0 = train on the data as is)
    save_every: int = 500
    log_every: int = 10
    save_dtype: str = "bfloat16"
    progress: bool = True


# ---- running the frozen target on plain rows -------------------------------------------------------

def row_metadata(rows: int, seq_len: int, device: torch.device, kv_cache: torch.Tensor):
    """Each row is one sequence of seq_len new tokens in its own block of a [rows*seq_len]-slot cache."""
    return build_metadata([seq_len] * rows, [seq_len] * rows, [[i] for i in range(rows)], seq_len, device,
                          kv_cache=kv_cache)


@torch.no_grad()
def target_outputs(model, ids: torch.Tensor, aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [rows, L] -> (features [rows, L, 3*H] fp32, logits [rows, L, vocab] fp32). One scratch cache is
    shared by every layer: each layer writes all its keys before reading them, so the next may overwrite."""
    rows, length = ids.shape
    device = ids.device
    layers = model.attention_layers()
    a = layers[0]
    scratch = torch.zeros(2, rows * length, a.num_kv_heads, a.head_dim, dtype=model.lm_head.weight.dtype,
                          device=device)
    kv_cache = scratch.expand(len(layers), *scratch.shape)  # [layers, 2, slots, kv_heads, head_dim], one memory
    positions = torch.arange(length, device=device).repeat(rows)
    hidden, aux = model(ids.flatten(), positions, row_metadata(rows, length, device, kv_cache), aux_layers)
    logits = model.compute_logits(hidden)
    feats = torch.cat(aux, dim=-1).float().view(rows, length, -1)
    return feats, logits.float().view(rows, length, -1)


# ---- the draft -------------------------------------------------------------------------------------

class _Embedding(nn.Module):
    """The target's embedding (frozen, shared), cast to the draft's compute dtype."""

    def __init__(self, embed: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.embed, self.dtype = embed, dtype

    def forward(self, ids):
        with torch.no_grad():
            return self.embed(ids).to(self.dtype)


def draft_config(arch: ArchConfig, draft_vocab: int, opts: TrainOptions) -> Eagle3Config:
    """The draft's shape from the target's (flags may override heads, MLP width and the aux layers, else
    EAGLE-3's default); `aux_layer_ids` is stored in the checkpoint's "output of layer i" convention."""
    c = Eagle3Config(
        hidden_size=arch.hidden_size, target_hidden_size=arch.hidden_size,
        intermediate_size=opts.intermediate_size or arch.intermediate_size,
        num_heads=opts.num_heads or arch.num_heads, num_kv_heads=opts.num_kv_heads or arch.num_kv_heads,
        head_dim=arch.head_dim if not opts.num_heads else arch.hidden_size // opts.num_heads,
        rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta, rope_scaling=arch.rope_scaling,
        max_position_embeddings=arch.max_position_embeddings, vocab_size=arch.vocab_size,
        draft_vocab_size=draft_vocab, aux_layer_ids=opts.aux_layer_ids)
    return replace(c, aux_layer_ids=tuple(i - 1 for i in c.target_aux_layers(arch.num_layers)))


def new_draft(c: Eagle3Config, embed: nn.Module, device: torch.device, seed: int) -> Eagle3Draft:
    with torch.device(device):
        draft = Eagle3Draft(c, embed)
    gen = torch.Generator().manual_seed(seed)
    for name, p in draft.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        p.requires_grad_(True)
    return draft


# ---- training-time test ----------------------------------------------------------------------------

def ttt_masks(length: int, steps: int) -> list[torch.Tensor]:
    """mask[s] [L, (s+1)*L]: origin j sees step-0 keys <= j and its own key in each of steps 1..s."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    eye = torch.eye(length, dtype=torch.bool)
    return [torch.cat([causal] + [eye] * s, dim=1) for s in range(steps)]


def ttt_loss(draft: Eagle3Draft, ids: torch.Tensor, feats: torch.Tensor, logits: torch.Tensor,
             t2d: torch.Tensor, steps: int, decay: float = 0.8):
    """ids [B, L] data tokens, feats [B, L, 3H], logits [B, L, vocab] the target's. Returns (loss, per-step
    loss list, per-step accuracy list, per-step count list)."""
    rows, length = ids.shape
    device = ids.device
    attn = draft.attention_layers()[0]
    # [1 layer, k/v, slots, kv_heads, head_dim]: no grad itself; index writes put it in the graph
    cache = torch.zeros(1, 2, rows * steps * length, attn.num_kv_heads, attn.head_dim, device=device)
    tables = [[i] for i in range(rows)]
    masks = ttt_masks(length, steps)
    d2t_ids = t2d.nonzero().squeeze(-1)  # draft id -> target id
    target_logp = logits[..., d2t_ids].log_softmax(-1)  # restricted and renormalised [B, L, Vd]
    target_top = logits.argmax(-1)  # [B, L]
    origin = torch.arange(length, device=device)
    hidden = feats.reshape(rows * length, -1)
    total, losses, accs, counts = 0.0, [], [], []
    for s in range(steps):
        tok_pos = origin + 1 + s  # input token j+1+s; the target's distribution at j+1+s labels it
        valid = tok_pos < length
        tok_pos = tok_pos.clamp(max=length - 1)
        tokens = ids[:, tok_pos].flatten()
        positions = (origin + s).repeat(rows)
        meta = build_metadata([length] * rows, [(s + 1) * length] * rows, tables, steps * length, device,
                              tree_masks=[masks[s]] * rows, kv_cache=cache)
        out, hidden = draft(tokens, hidden, positions, meta)  # [B*L, Vd], [B*L, H]
        out = out.view(rows, length, -1)[:, valid]
        want = target_logp[:, tok_pos][:, valid]
        n = out.shape[0] * out.shape[1]
        if n == 0:
            break
        loss = -(want.exp() * out.log_softmax(-1)).sum(-1).mean()
        pred = draft.to_target_ids(out.argmax(-1))
        acc = (pred == target_top[:, tok_pos][:, valid]).float().mean()
        total = total + decay ** s * loss
        losses.append(loss.item())
        accs.append(acc.item())
        counts.append(n)
    return total, losses, accs, counts


def learning_rate(opts: "TrainOptions", step: int) -> float:
    """The lr of 0-based step `step`: a linear warm-up, then constant or a cosine to lr * MIN_LR_RATIO
    at the last step (a function of the step alone, so that a resumed run continues the schedule)."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    if opts.lr_schedule == "constant":
        return opts.lr
    done = (step - opts.warmup_steps) / max(1, opts.steps - 1 - opts.warmup_steps)
    return opts.lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


# ---- saving ----------------------------------------------------------------------------------------

def save_draft(draft: Eagle3Draft, t2d: torch.Tensor, out: str, arch: ArchConfig, dtype: torch.dtype) -> None:
    """config.json + model.safetensors with the published EAGLE-3 tensor names."""
    tensors = {n: (t if n == "d2t" else t.to(dtype)).detach().cpu() for n, t in draft.state_dict().items()}
    tensors["t2d"] = t2d.cpu()
    save_checkpoint(out, draft.config.to_dict(torch_dtype=str(dtype).removeprefix("torch.")), tensors)


# ---- the loop --------------------------------------------------------------------------------------

def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def train(opts: TrainOptions) -> dict:
    from transformers import AutoTokenizer

    from .data import draft_vocabulary, pack_rows, self_distill_rows, tokenize_files

    if opts.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {opts.lr_schedule!r}: one of {', '.join(LR_SCHEDULES)}")
    if opts.warmup_steps < 0:
        raise ValueError(f"warmup steps {opts.warmup_steps} must be >= 0")
    device = pick_device(opts.device)
    torch.manual_seed(opts.seed)
    arch = ArchConfig.from_dict(read_config(opts.target))
    if opts.aux_layer_ids is not None and (len(opts.aux_layer_ids) != 3
                                           or not all(0 <= i < arch.num_layers for i in opts.aux_layer_ids)):
        raise ValueError(f"aux layer ids {list(opts.aux_layer_ids)}: three layers of 0..{arch.num_layers - 1}")
    if opts.seq_len + opts.ttt_steps > arch.max_position_embeddings:
        raise ValueError(f"seq-len {opts.seq_len} + ttt-steps exceeds the target's "
                         f"{arch.max_position_embeddings} positions")
    tok = AutoTokenizer.from_pretrained(opts.target)
    rows = pack_rows(tokenize_files(tok, opts.data), opts.seq_len, tok.eos_token_id)
    if opts.self_distill:
        rows = self_distill_rows(opts.target, rows, opts.self_distill, device.type,
                                 "float32" if device.type == "cpu" else "bfloat16")
    if rows.max() >= arch.vocab_size:
        raise ValueError(f"the tokenizer produces id {int(rows.max())}, the target has {arch.vocab_size} tokens")

    target = load_model(opts.target, torch.float32 if device.type == "cpu" else torch.bfloat16, device)
    target.requires_grad_(False)

    ckpt_path = os.path.join(opts.out, CHECKPOINT)
    state = torch.load(ckpt_path, map_location="cpu", weights_only=True) if opts.resume else None
    if opts.resume and state is None:
        raise FileNotFoundError(ckpt_path)
    if state is not None:
        t2d = state["t2d"]
    else:
        dv = opts.draft_vocab_size or min(arch.vocab_size, 32000)
        _, t2d = draft_vocabulary(rows, arch.vocab_size, dv)
    d2t = t2d.nonzero().squeeze(-1) - torch.arange(int(t2d.sum()))
    c = draft_config(arch, int(t2d.sum()), opts)
    aux = c.target_aux_layers(arch.num_layers)
    draft = new_draft(c, _Embedding(target.model.embed_tokens, torch.float32), device, opts.seed)
    draft.d2t.copy_(d2t)
    params = list(draft.parameters())
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)
    step = 0
    if state is not None:
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    t2d = t2d.to(device)

    os.makedirs(opts.out, exist_ok=True)
    log = open(os.path.join(opts.out, LOG), "a" if opts.resume else "w")
    gen = torch.Generator().manual_seed(opts.seed + step)
    order, cursor = torch.randperm(rows.shape[0], generator=gen), 0
    start, last = time.time(), {}
    progress = _Progress(opts.steps, step) if opts.progress else None
    try:
        while step < opts.steps:
            if cursor + opts.batch_size > len(order):
                order, cursor = torch.cat([order[cursor:], torch.randperm(rows.shape[0], generator=gen)]), 0
            batch = rows[order[cursor:cursor + opts.batch_size]].to(device)
            cursor += opts.batch_size
            feats, logits = target_outputs(target, batch, aux)
            for group in opt.param_groups:
                group["lr"] = learning_rate(opts, step)
            draft.train()
            loss, losses, accs, _ = ttt_loss(draft, batch, feats, logits, t2d, opts.ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, opts.grad_clip)
            opt.step()
            step += 1
            last = {"step": step, "loss": loss.item(), "step_loss": losses, "acc": accs,
                    "lr": opt.param_groups[0]["lr"]}
            log.write(json.dumps(last) + "\n")
            if progress is not None:
                progress.update(step, last)
            if step % opts.save_every == 0 or step == opts.steps:
                _checkpoint(ckpt_path, draft, opt, step, t2d)
    finally:
        log.close()
        if progress is not None:
            progress.close()
    save_draft(draft, t2d, opts.out, arch, getattr(torch, opts.save_dtype))
    last["seconds"] = time.time() - start
    return last


def _checkpoint(path: str, draft: Eagle3Draft, opt, step: int, t2d: torch.Tensor) -> None:
    tmp = path + ".tmp"
    torch.save({"draft": {k: v.cpu() for k, v in draft.state_dict().items()}, "optimizer": opt.state_dict(),
                "step": step, "t2d": t2d.cpu()}, tmp)
    os.replace(tmp, path)


class _Progress:
    """A rich progress bar with the loss and per-step accuracy (plain lines when rich is missing)."""

    def __init__(self, total: int, done: int):
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train-draft"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.fields[info]}"))
            self.task = self.bar.add_task("train", total=total, completed=done, info="")
            self.bar.start()
        except ImportError:
            self.bar = None

    def update(self, step: int, m: dict) -> None:
        info = f"loss {m['loss']:.3f} acc " + " ".join(f"{a:.2f}" for a in m["acc"])
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        else:
            print(f"step {step}: {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
