"""Prompts cut from a Python package's source, as a JSONL dataset for `specserve bench --dataset jsonl:FILE`.

    python benchmarks/package_prompts.py .venv/lib/python3.11/site-packages/rich /tmp/rich.jsonl \
        [--count 300] [--chars 600] [--seed 0]

Every .py file under the package folder (sorted paths, __pycache__ skipped) is cut at line boundaries into
consecutive slices of at most `--chars` characters: lines are added while the slice stays within the limit.
Slices shorter than half the limit (a file's tail, a tiny file), slices that are mostly blank and lines
longer than the limit (data tables) are left out. `--count` slices are drawn from all of them with a seeded
sample and written in the order they appear in the package, one {"prompt": "..."} a line. The same
arguments give the same file byte for byte.

Used for issue 18's criterion 3: the shipped pair was trained on CPython's standard library only, so a
third-party package's source is text it never saw.
"""
from __future__ import annotations

import argparse
import json
import os
import random


def source_files(package: str) -> list[str]:
    """The package's .py files, sorted by path relative to the package folder."""
    out = []
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out, key=lambda p: os.path.relpath(p, package))


def slices(text: str, chars: int) -> list[str]:
    """Consecutive slices of whole lines, each at most `chars` characters and at least half that."""
    out, current = [], ""
    for line in text.splitlines(keepends=True):
        if len(line) > chars:  # a line no slice can hold: end the slice before it, skip it
            out.append(current)
            current = ""
            continue
        if len(current) + len(line) > chars:
            out.append(current)
            current = ""
        current += line
    out.append(current)
    return [s for s in out if len(s) >= chars // 2 and len(s.strip()) >= chars // 4]


def package_prompts(package: str, count: int, chars: int, seed: int = 0) -> list[str]:
    every = []
    for path in source_files(package):
        with open(path, encoding="utf-8", errors="replace") as f:
            every += slices(f.read(), chars)
    if not every:
        raise SystemExit(f"no slices of {chars} characters in {package}")
    picked = sorted(random.Random(seed).sample(range(len(every)), min(count, len(every))))
    return [every[i] for i in picked]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("package", help="the package's folder, e.g. .venv/lib/python3.11/site-packages/rich")
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--count", type=int, default=300, help="prompts to write (default 300; fewer if the package "
                   "has fewer slices)")
    p.add_argument("--chars", type=int, default=600, help="the most characters a prompt has (default 600)")
    p.add_argument("--seed", type=int, default=0, help="which slices are drawn (default 0)")
    args = p.parse_args()
    prompts = package_prompts(args.package, args.count, args.chars, args.seed)
    with open(args.out, "w") as f:
        for text in prompts:
            f.write(json.dumps({"prompt": text}) + "\n")
    print(f"{len(prompts)} prompts, {sum(map(len, prompts)) / len(prompts):.0f} characters on average, "
          f"from {args.package} -> {args.out}")


if __name__ == "__main__":
    main()
