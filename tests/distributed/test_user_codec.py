"""A codec written as docs/adding_a_codec.md shows, in a module outside the package
(tests/usercodec/halftop.py), used from the command line with ``--import``: imported in the
launcher and in every spawned rank, carried by a resume and by compare's runs, listed by
``thinwire methods``; a module that cannot be imported is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from thinwire.cli import main

TESTS = Path(__file__).resolve().parents[1]
HALFTOP = TESTS / "usercodec" / "halftop.py"
SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
TASK = ["--task", "synthetic", "--batch-size", "16", *[a for k, v in SMALL.items() for a in ("--option", f"{k}={v}")]]


def _thinwire(*args: str, cwd: Path | None = None, pythonpath: bool = True,
              safe_path: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="300")  # rich wraps `thinwire methods` at the terminal's width
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(TESTS)  # the user's module is found by its dotted name
    flags = ["-P"] if safe_path else []  # -P: the current directory is not on sys.path (the console script's case)
    return subprocess.run([sys.executable, *flags, "-m", "thinwire", *args], capture_output=True, text=True,
                          timeout=240, env=env, cwd=cwd)


@pytest.mark.timeout(300)
def test_a_user_codec_trains_on_two_workers_and_a_resume_keeps_its_import(tmp_path):
    out = tmp_path / "run"
    r = _thinwire("train", *TASK, "--workers", "2", "--steps", "4", "--eval-every", "2", "--import",
                  "usercodec.halftop", "--method", "halftop:fraction=0.25", "--out", str(out), "--checkpoint-every",
                  "2", "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["method"].startswith("halftop:") and "fraction=0.25" in s["method"] and s["workers"] == 2
    assert s["config"]["imports"] == ["usercodec.halftop"] and s["compression_ratio"] > 1
    r = _thinwire("train", "--resume", str(out), "--steps", "6", "--quiet")  # no --import: the run's own
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["method"].startswith("halftop:") and s["resumed_from"] == 4 and s["steps"] == 6


@pytest.mark.timeout(300)
def test_compare_races_a_codec_imported_by_file_path(tmp_path):
    out = tmp_path / "race"
    r = _thinwire("compare", *TASK, "--workers", "2", "--steps", "2", "--eval-every", "2", "--import", str(HALFTOP),
                  "--methods", "identity,halftop", "--out", str(out), "--quiet", pythonpath=False)
    assert r.returncode == 0, r.stderr
    methods = {json.loads((d / "summary.json").read_text())["method"].split(":")[0] for d in (out / "runs").iterdir()}
    assert methods == {"identity", "halftop"}


def test_methods_lists_an_imported_codec_with_its_knobs(tmp_path):
    # a relative path, from the directory that holds it
    r = _thinwire("methods", "--import", "usercodec/halftop.py", cwd=TESTS, pythonpath=False)
    assert r.returncode == 0, r.stderr
    assert f"halftop  (gather, from {HALFTOP})" in r.stdout and "the first values of the tensor" in r.stdout
    assert "fraction" in r.stdout and "(0, 1]" in r.stdout


def test_a_module_in_the_current_directory_is_found_by_its_name(tmp_path):
    r = _thinwire("methods", "--import", "halftop", cwd=HALFTOP.parent, pythonpath=False, safe_path=True)
    assert r.returncode == 0 and "halftop  (gather, from halftop)" in r.stdout, r.stderr


@pytest.mark.parametrize("command", [["train"], ["compare", "--methods", "identity", "--out", "unused"], ["cost"],
                                     ["methods"]])
def test_a_module_that_cannot_be_imported_is_one_line_and_exit_2(command, capsys):
    assert main([*command, "--import", "no_such_user_codecs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == "thinwire: error: --import no_such_user_codecs: ModuleNotFoundError: No module named " \
                  "'no_such_user_codecs'"


@pytest.mark.parametrize("body, needle", [
    ("raise RuntimeError('no GPU here')\n", "--import {path}: RuntimeError: no GPU here"),
    ("from thinwire.codecs.identity import Identity\nfrom thinwire.codecs.specs import register\n\n\n"
     "@register\nclass Mine(Identity):\n    name = 'topk'\n",
     "--import {path}: ValueError: codec 'topk' registered twice"),
    (None, "--import {path}: ImportError: no such file {path}"),
])
def test_a_module_that_fails_to_import_names_itself_and_its_error(body, needle, tmp_path, capsys):
    path = tmp_path / "broken_user_codec.py"
    if body is not None:
        path.write_text(body)
    assert main(["methods", "--import", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle.format(path=path) in err, err


def test_a_file_named_like_another_module_is_imported_all_the_same(tmp_path, capsys):
    path = tmp_path / "codecs.py"  # Python's own codecs module is imported already
    path.write_text("IMPORTED = True\n")
    assert main(["methods", "--import", str(path)]) == 0
    assert "identity" in capsys.readouterr().out
