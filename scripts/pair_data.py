"""Data steps of the default-pair recipe (scripts/build_default_pair.sh).

    python scripts/pair_data.py stdlib --out DIR        copy this Python's non-test stdlib .py files
    python scripts/pair_data.py distill --stdlib DIR --out FILE
                                                        the draft's prompt text: training files (not
                                                        held out) whose sorted index % 3 != 2
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil

_spec = importlib.util.spec_from_file_location("train_target",
                                               os.path.join(os.path.dirname(__file__), "train_target.py"))
train_target = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_target)


def copy_stdlib(out: str) -> None:
    _, files = train_target.find_stdlib_files()
    for rel, full in files:
        os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
        shutil.copy(full, os.path.join(out, rel))
    print(f"{len(files)} files -> {out}")


def distill_text(stdlib: str, out: str) -> None:
    _, files = train_target.find_stdlib_files(stdlib)
    train = [full for rel, full in files if not train_target.is_heldout(rel)]
    with open(out, "w") as f:
        for i, full in enumerate(train):
            if i % 3 != 2:
                f.write(open(full, encoding="utf-8", errors="replace").read() + "\n")
    print(f"{os.path.getsize(out)} bytes -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("stdlib", "distill"))
    ap.add_argument("--stdlib")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    copy_stdlib(args.out) if args.step == "stdlib" else distill_text(args.stdlib, args.out)


if __name__ == "__main__":
    main()
