"""Data steps of the default-pair recipe (scripts/build_default_pair.sh).

    python scripts/pair_data.py stdlib --out DIR        copy this Python's non-test stdlib .py files
    python scripts/pair_data.py packages --list scripts/corpus_packages.json --out DIR [--wheels CACHE]
                                         [--max-package-bytes N]
                                                        fetch the listed packages' wheels (needs the package
                                                        index) and write their code under DIR/{train,heldout}/
                                                        NAME/, with DIR/manifest.json; a training package's
                                                        files (sorted) stop at N bytes, so that no package
                                                        outweighs the rest
    python scripts/pair_data.py distill --stdlib DIR [--packages DIR] --out FILE
                                                        the draft's prompt text: training files (not
                                                        held out) whose sorted index % 3 != 2
"""
from __future__ import annotations

import argparse
import email
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile

_spec = importlib.util.spec_from_file_location("train_target",
                                               os.path.join(os.path.dirname(__file__), "train_target.py"))
train_target = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_target)


def copy_stdlib(out: str) -> None:
    """This Python's non-test stdlib .py files into out, with out/SOURCE.json naming the Python they came from
    (the training step, often on another machine, records it in the target's corpus.json)."""
    root, files = train_target.find_stdlib_files()
    for rel, full in files:
        os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
        shutil.copy(full, os.path.join(out, rel))
    with open(os.path.join(out, train_target.STDLIB_SOURCE), "w") as f:
        json.dump({"python_version": platform.python_version(), "stdlib_path": root}, f, indent=2)
    print(f"{len(files)} files -> {out}")


# path parts and file names that are not the package's own code
SKIPPED_PARTS = {"tests", "test", "testing", "_vendor", "vendor", "vendored", "__pycache__"}
LICENCE_WORDS = {"MIT": "mit", "BSD": "bsd", "Apache": "apache", "PSF": "python software foundation",
                 "Unlicense": "unlicense"}


def is_code(member: str) -> bool:
    """A wheel member that is the package's own Python code (no tests, no vendored copies, no metadata)."""
    parts = member.split("/")
    name = parts[-1]
    return (name.endswith(".py") and not any(p.endswith((".dist-info", ".data")) for p in parts)
            and not SKIPPED_PARTS & set(parts[:-1])
            and not (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"))


def declared_licence(wheel: zipfile.ZipFile) -> str:
    """What the wheel's METADATA says: License-Expression, else License's first line, plus the classifiers."""
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    m = email.message_from_bytes(wheel.read(meta))
    own = m.get("License-Expression") or (m.get("License") or "").split("\n")[0]
    classifiers = [c.split("::")[-1].strip() for c in m.get_all("Classifier") or [] if c.startswith("License ::")]
    return "; ".join(x for x in [own.strip(), *classifiers] if x)


def check_licence(name: str, listed: str, declared: str) -> None:
    """Every licence family the list names must appear in what the wheel declares."""
    for family, word in LICENCE_WORDS.items():
        if family in listed and word not in declared.lower():
            raise SystemExit(f"{name}: listed as {listed!r} but its wheel declares {declared!r}")
    if not any(family in listed for family in LICENCE_WORDS):
        raise SystemExit(f"{name}: licence {listed!r} is not one the recipe accepts ({', '.join(LICENCE_WORDS)})")


def wheel_file(wheels: str, name: str, version: str) -> str:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for f in sorted(os.listdir(wheels)):
        parts = f.split("-")
        if f.endswith(".whl") and parts[0].lower() == stem and parts[1] == version:
            return os.path.join(wheels, f)
    raise SystemExit(f"{name}=={version}: no wheel in {wheels}")


def fetch_packages(listing: str, out: str, wheels: str, max_bytes: int | None = None) -> None:
    """Download the listed wheels (py3-none-any, no dependencies) and write their code, deduplicated by
    content across packages, under out/{train,heldout}/NAME/ (a training package's up to max_bytes);
    out/manifest.json says what came from where."""
    packages = json.load(open(listing))["packages"]
    os.makedirs(wheels, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--python-version",
                    "3.12", "--implementation", "py", "--abi", "none", "--platform", "any", "-q", "-d", wheels,
                    *(f"{p['name']}=={p['version']}" for p in packages)], check=True)
    seen: set[str] = set()
    manifest = []
    for p in packages:
        path = wheel_file(wheels, p["name"], p["version"])
        with zipfile.ZipFile(path) as wheel:
            declared = declared_licence(wheel)
            check_licence(p["name"], p["licence"], declared)
            files = size = duplicates = capped = 0
            for member in sorted(m for m in wheel.namelist() if is_code(m)):
                if max_bytes is not None and p["split"] == "train" and size >= max_bytes:
                    capped += 1
                    continue
                data = wheel.read(member)
                digest = hashlib.sha1(data).hexdigest()
                if digest in seen or not data.strip():
                    duplicates += bool(data.strip())
                    continue
                seen.add(digest)
                dest = os.path.join(out, p["split"], p["name"], member)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest, "wb") as f:
                    f.write(data)
                files, size = files + 1, size + len(data)
        manifest.append({**p, "declared_licence": declared, "wheel": os.path.basename(path),
                         "wheel_sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(), "files": files,
                         "bytes": size, "duplicates_skipped": duplicates, "files_past_cap": capped})
        print(f"{p['split']:8s} {p['name']}=={p['version']}: {files} files, {size:,} bytes")
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"listing": os.path.basename(listing), "max_package_bytes": max_bytes, "packages": manifest}, f,
                  indent=1)


def distill_text(stdlib: str, out: str, packages: str | None = None) -> None:
    _, files = train_target.find_stdlib_files(stdlib)
    train = [full for rel, full in files if not train_target.is_heldout(rel)]
    if packages:
        train += [full for _, full in train_target.package_files(packages, "train")]
    with open(out, "w") as f:
        for i, full in enumerate(train):
            if i % 3 != 2:
                f.write(open(full, encoding="utf-8", errors="replace").read() + "\n")
    print(f"{os.path.getsize(out)} bytes -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("stdlib", "packages", "distill"))
    ap.add_argument("--stdlib")
    ap.add_argument("--packages", help="distill: the packages step's folder (its training packages join in)")
    ap.add_argument("--list", default=os.path.join(os.path.dirname(__file__), "corpus_packages.json"))
    ap.add_argument("--wheels", help="packages: where the wheels are downloaded (default: OUT/../wheels)")
    ap.add_argument("--max-package-bytes", type=int, default=None, help="packages: cap on a training package's code")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.step == "stdlib":
        copy_stdlib(args.out)
    elif args.step == "packages":
        fetch_packages(args.list, args.out, args.wheels or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                                                        "wheels"), args.max_package_bytes)
    else:
        distill_text(args.stdlib, args.out, args.packages)


if __name__ == "__main__":
    main()
