"""Training data for draft heads: raw text packed into fixed-length rows, the draft vocabulary, and
optional self-distillation (the target regenerates continuations, as the EAGLE recipe trains on)."""
from __future__ import annotations

import torch


def tokenize_files(tokenizer, files: list[str]) -> list[list[int]]:
    """One token list per file (the whole file is one document)."""
    docs = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids:
            docs.append(ids)
    if not docs:
        raise ValueError(f"no tokens in {files!r}")
    return docs


def pack_rows(docs: list[list[int]], seq_len: int, eos: int | None) -> torch.Tensor:
    """Concatenate the documents (eos between them) and cut into rows of seq_len [rows, seq_len];
    a corpus shorter than one row is repeated to fill it."""
    stream: list[int] = []
    for d in docs:
        stream.extend(d)
        if eos is not None:
            stream.append(eos)
    while len(stream) < seq_len:
        stream = stream + stream
    rows = len(stream) // seq_len
    return torch.tensor(stream[:rows * seq_len], dtype=torch.long).view(rows, seq_len)


def draft_vocabulary(rows: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft_vocab_size most frequent target tokens in the data (ties and tokens never seen are filled
    in id order). Returns (d2t int64 offsets [draft_vocab]: target = draft + d2t[draft], t2d bool [vocab])."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocabulary size {draft_vocab_size} must be in 1..{vocab_size}")
    counts = torch.bincount(rows.flatten(), minlength=vocab_size)[:vocab_size].double()
    # stable order: by count descending, then by id
    score = counts * (vocab_size + 1) - torch.arange(vocab_size, dtype=torch.double) / (vocab_size + 1)
    kept = score.topk(draft_vocab_size).indices.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def self_distill_rows(target: str, rows: torch.Tensor, prompt_len: int, device: str, dtype: str) -> torch.Tensor:
    """Replace each row by its first prompt_len tokens followed by the target's own greedy continuation
    (specserve's engine, no speculation), so the draft learns what the target actually says."""
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    seq_len = rows.shape[1]
    llm = LLM(target, device=device, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=seq_len - prompt_len, ignore_eos=True)
    outs = llm.generate([r[:prompt_len].tolist() for r in rows], params)
    new = [r[:prompt_len].tolist() + o.token_ids for r, o in zip(rows, outs)]
    del llm
    return torch.tensor([n[:seq_len] for n in new], dtype=torch.long)
