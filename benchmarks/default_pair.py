"""Quality and speed of the shipped default pair, measured side by side in one run, on two held-out sets:
held-out stdlib files (the files listed in the target's corpus.json) and held-out packages (whole packages
the pair never trained on: corpus.json's `packages` with split "heldout", else those of
scripts/corpus_packages.json; their code is read from this environment's installed distributions, which
specserve's own dependencies provide, and the version read is reported).

    python benchmarks/default_pair.py [--files 94] [--package-files 96] [--rounds 3] [--out pair.json]
                                      [--target DIR --draft DIR] [--skip-speed | --parse-only]

`--parse-only` runs check 2 alone, on the target (greedy text does not depend on the draft), so a target
can be judged before a drafter is trained for it.

Per set:
1. Acceptance: greedy continuations of each held-out file's opening, for a chain of 3 and a tree (topk 4,
   8 draft tokens): mean acceptance length (bonus included) and acceptance per position.
2. Plausible Python: held-out function headers (def line and docstring) continued greedily; the share
   whose body parses with `ast`.
3. Speed at concurrency 1 on this machine (held-out packages when found, else stdlib): plain vs chain vs
   tree output tokens/s, rounds interleaved so that noise hits every configuration alike; the median ratio
   to plain.
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sysconfig
import textwrap
import time

from specserve import LLM, SamplingParams
from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET


def configs(draft: str) -> dict:
    return {
        "plain": dict(speculative_algorithm="none"),
        "chain3": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_policy="always",
                       speculative_num_steps=3, speculative_eagle_topk=1),
        "tree4x8": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_policy="always",
                        speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
        "adaptive": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                         speculative_num_steps=3, speculative_eagle_topk=1),
    }


def held_out_texts(stdlib: str, limit: int, target: str = SHIPPED_TARGET) -> list[tuple[str, str]]:
    corpus = json.load(open(os.path.join(target, "corpus.json")))
    files = corpus["heldout_file_list"]
    out = []
    for rel in files[:limit]:
        path = os.path.join(stdlib, rel)
        if os.path.isfile(path):
            out.append((rel, open(path, encoding="utf-8", errors="replace").read()))
    return out


HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def pair_data():
    """scripts/pair_data.py, the recipe's data steps (its `is_code`: a package's own code, no tests, no
    vendored copies)."""
    spec = importlib.util.spec_from_file_location("pair_data", os.path.join(HERE, "..", "scripts", "pair_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held_out_packages(target: str) -> list[str]:
    """The packages the target never trained on: its corpus.json's held-out ones, else the recipe's list."""
    corpus = json.load(open(os.path.join(target, "corpus.json")))
    listed = corpus.get("packages")
    if not listed:
        listed = json.load(open(os.path.join(HERE, "..", "scripts", "corpus_packages.json")))["packages"]
    return [p["name"] for p in listed if p["split"] == "heldout"]


def package_texts(names: list[str], limit: int) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Up to `limit` (NAME/path, text) of the installed packages' own code (no tests, no vendored copies),
    taken in turn from each package (sorted paths); and the version of each package found."""
    per_package, versions = [], {}
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        versions[name] = dist.version
        files = sorted(str(f) for f in dist.files or [] if pair_data().is_code(str(f)))
        texts = [(f"{name}/{f}", open(dist.locate_file(f), encoding="utf-8", errors="replace").read())
                 for f in files]
        per_package.append([t for t in texts if t[1].strip()])
    out = []
    while len(out) < limit and any(per_package):
        for texts in per_package:
            if texts and len(out) < limit:
                out.append(texts.pop(0))
    return out, versions


def acceptance(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    before = llm.engine.stats.spec
    drafts0, acc0, pos0 = before.num_drafts, before.num_accepted_tokens, list(before.accepted_per_position)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    s = llm.engine.stats.spec
    drafts = s.num_drafts - drafts0
    per_pos = [(a - (pos0[i] if i < len(pos0) else 0)) / drafts for i, a in enumerate(s.accepted_per_position)]
    return {"mean_acceptance_length": 1 + (s.num_accepted_tokens - acc0) / drafts, "drafts": drafts,
            "accepted_per_position": [round(p, 3) for p in
                                      per_pos[:llm.engine.config.speculative.speculative_num_steps]]}


def function_headers(texts: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """(prompt ending with a def line and the body's indentation, the def line's indentation) per
    held-out file's first function. The prompt ends inside the indentation, as training text has it:
    the pre-tokenizer keeps the last space of an indentation for the next word ("\n   " + " return"),
    so the prompt ends with the indentation less one space."""
    out = []
    for _, text in texts:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                indent = line[:len(line) - len(line.lstrip())]
                out.append(("".join(lines[max(0, i - 30):i + 1]) + indent + "   ", indent))
                break
        if len(out) >= limit:
            break
    return out


def body_parses(header: str, indent: str, completion: str, cut: bool) -> bool:
    """Does the def line plus the completion, up to where it dedents (and without a last line cut off
    by max_tokens), parse?"""
    body = []
    lines = (indent + "   " + completion).splitlines()
    for line in lines[:-1] if cut else lines:
        if line.strip() and not line.startswith(indent + " ") and not line.startswith(indent + "\t"):
            break  # dedented back to the def's level: the function ended
        body.append(line)
    def_line = header.splitlines()[-2]
    source = textwrap.dedent("\n".join([def_line] + body))
    try:
        ast.parse(source)
        return bool(body)
    except SyntaxError:
        return False


def speed(llms: dict, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            t0, n = time.perf_counter(), 0
            for p in prompts:  # concurrency 1: one request at a time
                n += len(llm.generate([p], params)[0].token_ids)
            rates[name].append(n / (time.perf_counter() - t0))
    plain = rates["plain"]
    return {name: {"output_tok_s": [round(r, 1) for r in rs],
                   "median_ratio_to_plain": round(statistics.median(r / p for r, p in zip(rs, plain)), 3)}
            for name, rs in rates.items()}


def evaluate(llms: dict, texts: list[tuple[str, str]], args) -> tuple[dict, list[list[int]]]:
    """Acceptance of a chain and a tree (when llms has them) and the ast parse rate on these held-out texts;
    their prompts."""
    tok = llms["plain"].tokenizer
    prompts = [tok.encode(t)[:args.prompt_tokens] for _, t in texts]
    report: dict = {"held_out_files": len(texts)}
    for name in ("chain3", "tree4x8"):
        if name in llms:
            report[name] = acceptance(llms[name], prompts, args.max_tokens)
            print(name, report[name], flush=True)
    headers = function_headers(texts, 50)
    outs = llms.get("chain3", llms["plain"]).generate([h for h, _ in headers],
                                   SamplingParams(temperature=0, max_tokens=128, stop=["\ndef ", "\nclass "]))
    parsed = sum(body_parses(h, ind, o.text, o.finish_reason == "length") for (h, ind), o in zip(headers, outs))
    report["ast_parse_rate"] = {"parsed": parsed, "total": len(headers)}
    print("ast parse rate", parsed, "/", len(headers), flush=True)
    return report, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--files", type=int, default=94, help="held-out stdlib files to use (94 = all)")
    ap.add_argument("--package-files", type=int, default=96, help="held-out package files, in turn per package")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speed-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--target", default=SHIPPED_TARGET, help="target folder (default: the shipped one)")
    ap.add_argument("--draft", default=SHIPPED_DRAFT, help="EAGLE-3 folder (default: the shipped one)")
    ap.add_argument("--skip-speed", action="store_true", help="acceptance and ast only")
    ap.add_argument("--parse-only", action="store_true", help="the ast check alone, on the target (no draft needed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    wanted = ("plain",) if args.parse_only else tuple(configs(args.draft))
    llms = {name: LLM(args.target, **opts) for name, opts in configs(args.draft).items() if name in wanted}
    print("held-out stdlib files", flush=True)
    report: dict = {}
    report["stdlib"], prompts = evaluate(llms, held_out_texts(args.stdlib, args.files, args.target), args)
    texts, versions = package_texts(held_out_packages(args.target), args.package_files)
    if texts:
        print("held-out packages", versions, flush=True)
        report["packages"], prompts = evaluate(llms, texts, args)
        report["packages"]["versions"] = versions
    if not (args.skip_speed or args.parse_only):
        report["speed_concurrency_1"] = speed(llms, prompts[:args.speed_prompts], args.max_tokens, args.rounds)
        report["speed_concurrency_1"]["on"] = "packages" if texts else "stdlib"
        print(json.dumps(report["speed_concurrency_1"], indent=1))
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
