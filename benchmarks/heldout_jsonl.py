"""Write the shipped target's held-out stdlib files as a `specserve bench` dataset (`--dataset jsonl:FILE`).

    python benchmarks/heldout_jsonl.py --out heldout.jsonl [--chars 600] [--stdlib DIR]

One prompt per file of the target's `heldout_file_list` (94 files, never trained on), its first `--chars`
characters: fresh code prompts for `specserve compare --fresh-prompts` through a server.
"""
from __future__ import annotations

import argparse
import json
import sysconfig

from default_pair import held_out_texts  # benchmarks/ is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--chars", type=int, default=600)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="where the held-out files are")
    args = ap.parse_args()
    texts = held_out_texts(args.stdlib, 1 << 30)
    if not texts:
        raise SystemExit(f"no held-out files under {args.stdlib}: pass --stdlib")
    with open(args.out, "w") as f:
        for _, text in texts:
            f.write(json.dumps({"prompt": text[:args.chars]}) + "\n")
    print(f"{len(texts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
