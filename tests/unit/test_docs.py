"""The docs name every method the code registers: the README's methods table and
docs/methods.md list every codec, policy preset and averaging algorithm."""

import pathlib

import pytest

from thinwire.algorithms.methods import markdown_table, method_names

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/methods.md"])
def test_every_method_is_documented(doc):
    text = (ROOT / doc).read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    missing = [name for name in method_names() if f"`{name}" not in table]
    assert not missing, f"{doc} has no table row for {missing}"


def test_the_method_index_is_generated_from_the_registries():
    """docs/methods.md's index is exactly what the registries say (regenerate it with
    `thinwire methods --markdown`)."""
    text = (ROOT / "docs/methods.md").read_text()
    start = text.index(INDEX_START) + len(INDEX_START)
    assert text[start : text.index(INDEX_END)].strip() == markdown_table().strip()


INDEX_START = "<!-- index: thinwire methods --markdown -->"
INDEX_END = "<!-- end of index -->"
