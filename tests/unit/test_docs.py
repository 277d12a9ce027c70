"""The docs name every method the code registers: the README's methods table and
docs/methods.md list every codec, policy preset and averaging algorithm."""

import pathlib

import pytest

from thinwire.algorithms.registry import algorithms
from thinwire.codecs.registry import available
from thinwire.policy import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/methods.md"])
def test_every_method_is_documented(doc):
    text = (ROOT / doc).read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    missing = [name for name in [*available(), *PRESETS, *algorithms()] if f"`{name}" not in table]
    assert not missing, f"{doc} has no table row for {missing}"
