"""The default pair's corpus recipe (scripts/pair_data.py, scripts/train_target.py): which wheel members are
code, licences checked against the list, held-out packages kept out of training, texts kept once."""
from __future__ import annotations

import importlib.util
import json
import os
import zipfile

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "scripts")


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_members_that_are_code():
    is_code = script("pair_data").is_code
    assert is_code("rich/console.py") and is_code("_pytest/python.py")
    assert not is_code("pkg/tests/test_x.py") and not is_code("pkg/test_util.py")
    assert not is_code("pkg/util_test.py") and not is_code("pkg/conftest.py")
    assert not is_code("pip/_vendor/six.py") and not is_code("pkg-1.0.dist-info/RECORD")
    assert not is_code("pkg/data.json")


def test_licences_are_checked_against_the_wheel(tmp_path):
    pair_data = script("pair_data")
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n"
                   "Classifier: License :: OSI Approved :: MIT License\n\n")
    with zipfile.ZipFile(wheel) as z:
        declared = pair_data.declared_licence(z)
    assert "MIT License" in declared
    pair_data.check_licence("pkg", "MIT", declared)
    with pytest.raises(SystemExit, match="declares"):
        pair_data.check_licence("pkg", "BSD-3-Clause", declared)
    with pytest.raises(SystemExit, match="not one the recipe accepts"):
        pair_data.check_licence("pkg", "GPL-3.0", "GPL")
    assert pair_data.wheel_file(str(tmp_path), "PKG", "1.0") == str(wheel)


def test_held_out_packages_stay_out_of_training_and_texts_are_kept_once(tmp_path):
    train_target = script("train_target")
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    (stdlib / "a.py").write_text("x = 1\n")
    for split, name, files in (("train", "alpha", {"m.py": "y = 2\n", "dup.py": "x = 1\n"}),
                               ("heldout", "beta", {"n.py": "z = 3\n"})):
        for fn, text in files.items():
            path = tmp_path / "pk" / split / name / name / fn
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    (tmp_path / "pk" / "manifest.json").write_text(json.dumps({"packages": [
        {"name": "alpha", "version": "1", "licence": "MIT", "split": "train", "files": 2, "bytes": 12, "x": 0},
        {"name": "beta", "version": "2", "licence": "MIT", "split": "heldout", "files": 1, "bytes": 6}]}))
    _, train, held, held_packages = train_target.load_corpus(str(stdlib), str(tmp_path / "pk"))
    names = [rel for rel, _ in train + held]
    assert "pkg:alpha/alpha/m.py" in names and "pkg:alpha/alpha/dup.py" not in names  # same text as a.py
    assert [rel for rel, _ in held_packages] == ["pkg:beta/beta/n.py"]
    assert not any(rel.startswith("pkg:beta") for rel in names)
    assert [p["name"] for p in train_target.package_manifest(str(tmp_path / "pk"))] == ["alpha", "beta"]


def test_a_copied_stdlib_names_the_python_it_came_from(tmp_path, monkeypatch):
    """The stdlib step runs on one machine and training on another: corpus.json must name the copy's Python,
    not the trainer's."""
    pair_data, train_target = script("pair_data"), script("train_target")
    src = tmp_path / "lib"
    (src / "json").mkdir(parents=True)
    (src / "json" / "decoder.py").write_text("x = 1\n")
    (src / "test_skip.py").write_text("y = 2\n")
    monkeypatch.setattr(pair_data.train_target.sysconfig, "get_paths", lambda: {"stdlib": str(src)})
    monkeypatch.setattr(pair_data.platform, "python_version", lambda: "3.99.1")
    out = tmp_path / "copy"
    pair_data.copy_stdlib(str(out))
    assert (out / "json" / "decoder.py").is_file() and not (out / "test_skip.py").exists()
    assert train_target.stdlib_source(str(out)) == ("3.99.1", str(src))
    assert train_target.stdlib_source(str(src))[1] == str(src)  # not a copy: this Python's own
