"""The codec of docs/adding_a_codec.md, run through the checks every built-in codec gets.

The doc's first ``python`` block is executed as a module of its own (so its codec registers as
a user's codec would), its ``BOUNDS`` block gives the round-trip bound, and then every generic
test of tests/unit/test_codecs.py, test_fuzz_codecs.py and test_payload_rules.py runs on it
with the parameters those tests give a built-in peer (a single-round codec of the same
aggregation), plus the checks that walk every registered codec (test_aggregate.py,
test_codecs.py). "Generic" is found, not listed: a test parametrized over a spec or name whose
values cover every single-round built-in codec of the example's aggregation, so a generic test
added later runs here too. The codec is unregistered afterwards: the other test files see the
registry as it was.

The same pattern runs the checks on a codec of your own module: import it instead of
executing the block, and give it a bound.
"""

from __future__ import annotations

import inspect
import itertools
import math
import pathlib
import re
import sys
import textwrap
import types

import pytest
import torch

from thinwire.codecs import specs

# the generic checks: the same modules pytest collects (it puts tests/unit on sys.path; so does this
# line, for --import-mode=importlib)
HERE = str(pathlib.Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import test_aggregate  # noqa: E402
import test_codecs  # noqa: E402
import test_fuzz_codecs  # noqa: E402
import test_payload_rules  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adding_a_codec.md"
BUILTIN = dict(specs.available())  # before the example registers
GENERIC_MODULES = {test_codecs: ("spec",), test_fuzz_codecs: ("spec",), test_payload_rules: ("name",)}
# checks that walk every registered codec at run time (no parameter to substitute)
EVERY_REGISTERED = [test_aggregate.test_every_codec_decodes_from_wire_tensors_alone,
                    test_codecs.test_only_stateless_one_round_sum_codecs_launch_in_backward]


def _blocks() -> list[str]:
    """The doc's ``python`` code blocks, dedented (a block inside a list item is indented)."""
    found = re.findall(r"^( *)```python\n(.*?)^\1```", DOC.read_text(), re.DOTALL | re.MULTILINE)
    return [textwrap.dedent(body) for _, body in found]


def _codec_block() -> str:
    found = [b for b in _blocks() if "@register" in b]
    assert len(found) == 1, f"{DOC.name}: expected one python block with a @register codec, found {len(found)}"
    return found[0]


def _doc_bounds() -> dict:
    found = [b for b in _blocks() if b.startswith("# tests/unit/test_codecs.py, in BOUNDS")]
    assert len(found) == 1, f"{DOC.name}: expected one python block of BOUNDS entries, found {len(found)}"
    return eval("{" + found[0] + "}", {"math": math, "torch": torch})  # the repository's own doc


def _unregister(name: str) -> None:
    specs.CODECS.remove(name)


@pytest.fixture(scope="module")
def example():
    """The doc's codec class, registered for this module's tests only."""
    module = types.ModuleType("adding_a_codec_example")
    module.__file__ = str(DOC)
    sys.modules[module.__name__] = module  # as an imported module: dataclasses and type hints look it up
    added: set[str] = set()
    try:
        exec(compile(_codec_block(), str(DOC), "exec"), module.__dict__)  # noqa: S102
        added = set(specs.available()) - set(BUILTIN)
        assert len(added) == 1, f"the example registered {sorted(added)}, expected one codec"
        yield specs.available()[next(iter(added))]
    finally:
        for name in added:
            _unregister(name)
        sys.modules.pop(module.__name__, None)
        assert set(specs.available()) == set(BUILTIN), "the example's codec is still registered"


@pytest.fixture
def registered(example, monkeypatch):
    """The example, also in the generic modules' own snapshots of the registry and in BOUNDS."""
    for module in GENERIC_MODULES:
        if isinstance(getattr(module, "CODECS", None), dict):
            monkeypatch.setitem(module.CODECS, example.name, example)
    bounds = _doc_bounds()
    assert example.name in bounds, f"{DOC.name}'s BOUNDS block has no entry for {example.name!r}"
    monkeypatch.setitem(test_codecs.BOUNDS, example.name, bounds[example.name])
    return example


def _grid(fn) -> list[dict]:
    """Every parameter set ``fn``'s parametrize marks give it (their cartesian product)."""
    grids = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        argnames, argvalues = mark.args[0], mark.args[1]
        names = [a.strip() for a in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        rows = []
        for v in argvalues:
            v = v.values if type(v).__name__ == "ParameterSet" else v
            rows.append(dict(zip(names, v if len(names) > 1 else (v,))))
        grids.append(rows)
    return [dict(itertools.chain.from_iterable(d.items() for d in combo)) for combo in itertools.product(*grids)]


def _peers(example) -> set[str]:
    return {n for n, cls in BUILTIN.items() if cls.rounds == example.rounds == 1 and
            cls.aggregation is example.aggregation}


def generic_cases(module, example) -> list[tuple[object, dict]]:
    """(test function, keyword arguments) for every generic test of ``module``, with the
    example in place of the peer that test has the most cases for."""
    peers, cases = _peers(example), []
    assert peers, f"no built-in single-round {example.aggregation} codec to take the parameters of"
    for attr, fn in sorted(vars(module).items()):
        if not (attr.startswith("test_") and callable(fn)):
            continue
        grid = _grid(fn)
        for key in GENERIC_MODULES[module]:
            values = {row.get(key) for row in grid}
            if not peers <= values:
                continue  # not over every peer: a method's own test, or none of this key
            peer = max(sorted(peers), key=lambda p: sum(row[key] == p for row in grid))
            cases += [(fn, {**row, key: example.name}) for row in grid if row[key] == peer]
    return cases


def _run(cases, monkeypatch, tmp_path) -> None:
    """Run every case; one failure lists them all."""
    failures = []
    for fn, kwargs in cases:
        extra = {k: v for k, v in (("monkeypatch", monkeypatch), ("tmp_path", tmp_path))
                 if k in inspect.signature(fn).parameters}
        try:
            fn(**kwargs, **extra)
        except Exception as e:  # noqa: BLE001  (AssertionError, or the codec raising)
            failures.append(f"{fn.__module__}.{fn.__name__}({kwargs}): {type(e).__name__}: {str(e)[:400]}")
    assert not failures, f"{len(failures)} of {len(cases)} checks failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("module", list(GENERIC_MODULES), ids=lambda m: m.__name__)
def test_the_generic_checks_pass_on_the_doc_example(module, registered, monkeypatch, tmp_path):
    cases = generic_cases(module, registered)
    assert cases, f"no generic test found in {module.__name__}"
    _run(cases, monkeypatch, tmp_path)


def test_the_checks_over_every_registered_codec_pass_with_the_example(registered, monkeypatch, tmp_path):
    _run([(fn, {}) for fn in EVERY_REGISTERED], monkeypatch, tmp_path)


def test_the_generic_tests_found_are_the_contract_ones(registered):
    """The discovery finds the contract tests (a guard on the discovery itself): in
    test_codecs, the ones over every codec or every single-round codec."""
    found = {fn.__name__ for fn, _ in generic_cases(test_codecs, registered)}
    assert {"test_nbytes_and_wire_spec_match_the_payload", "test_decode_has_input_shape_and_dtype",
            "test_round_trip_error_within_bound", "test_low_precision_input_round_trip",
            "test_error_feedback_identity", "test_zero_input_decodes_to_zero",
            "test_non_contiguous_input_equals_its_contiguous_copy", "test_encode_does_not_modify_input",
            "test_same_seed_step_key_rank_gives_same_payload", "test_decode_add_equals_dense_add",
            "test_decode_to_writes_exactly_what_decode_returns", "test_describe_rebuilds_the_same_config"} <= found
    shapes = {tuple(kw["shape"]) for fn, kw in generic_cases(test_codecs, registered)
              if fn.__name__ == "test_nbytes_and_wire_spec_match_the_payload"}
    assert (0,) in shapes  # the empty tensor is among them
    assert {fn.__name__ for fn, _ in generic_cases(test_payload_rules, registered)} == {
        "test_a_declared_dtype_that_is_not_real_floating_point_is_refused",
        "test_a_declared_shape_with_a_negative_dimension_is_refused"}
    assert {fn.__name__ for fn, _ in generic_cases(test_fuzz_codecs, registered)} == {
        "test_round_trip_never_crashes_and_keeps_its_declared_layout", "test_error_feedback_conserves_u",
        "test_a_payload_with_the_wrong_layout_is_refused_by_every_decoder"}


def test_what_the_doc_says_a_builtin_codec_needs_is_what_the_tests_require(registered, monkeypatch):
    """Each item of the doc's list is enforced: a built-in codec without a BOUNDS entry fails
    the bound test, one without table rows fails the docs test for README.md and
    docs/methods.md; the tests the doc names exist."""
    import test_docs  # here, not at the top: the other checks run even while it cannot import

    name, text = registered.name, DOC.read_text()
    monkeypatch.setattr(test_codecs, "SINGLE", [*test_codecs.SINGLE, name])  # as if it were built in
    test_codecs.test_every_single_round_codec_has_a_round_trip_bound()  # with the doc's BOUNDS entry
    monkeypatch.delitem(test_codecs.BOUNDS, name)
    with pytest.raises(AssertionError, match=name):
        test_codecs.test_every_single_round_codec_has_a_round_trip_bound()
    for doc in ("README.md", "docs/methods.md"):
        assert f"`{doc}`" in text, f"{DOC.name} does not name {doc}"
        with pytest.raises(AssertionError, match=f"{doc} has no table row for .*{name}"):
            test_docs.test_every_method_is_documented(doc)
    named = set(re.findall(r"`(test_\w+)`", text))
    assert named, f"{DOC.name} names no test"
    for test in named:
        assert hasattr(test_codecs, test) or hasattr(test_docs, test), (
            f"{DOC.name} names {test}, which no longer exists")
