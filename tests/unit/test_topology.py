"""Mixing matrices: the built-in graphs' weights and neighbours, validation, files, spectral gap."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.topology import Topology, build_topology, complete, exponential, ring, torus, torus_shape


def _check_mixing(t: Topology) -> None:
    w = t.weights
    assert torch.allclose(w, w.T, atol=0, rtol=0) or (w - w.T).abs().max() < 1e-12
    torch.testing.assert_close(w.sum(0), torch.ones(t.n, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(w.sum(1), torch.ones(t.n, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring(n):
    t = ring(n)
    _check_mixing(t)
    if n >= 3:
        assert t.neighbours(0) == sorted({1, n - 1}) and t.weight(0, 1) == pytest.approx(1 / 3)
        assert all(t.degree(i) == 2 for i in range(n))
    elif n == 2:
        assert t.neighbours(0) == [1] and t.weight(0, 1) == 0.5


@pytest.mark.parametrize("n, shape", [(9, (3, 3)), (12, (3, 4)), (16, (4, 4)), (18, (3, 6))])
def test_torus(n, shape):
    assert torus_shape(n) == shape
    t = torus(n)
    _check_mixing(t)
    assert all(t.degree(i) == 4 for i in range(n)) and t.weight(0, 1) == pytest.approx(1 / 5)
    rows, cols = shape
    assert t.neighbours(0) == sorted({1, cols - 1, cols, (rows - 1) * cols})


@pytest.mark.parametrize("n", [4, 7, 8, 13])
def test_torus_of_a_size_without_a_factorisation_is_refused(n):
    with pytest.raises(ValueError, match=f"a torus needs workers = rows x cols with rows, cols >= 3.*{n} has no"):
        torus(n)


@pytest.mark.parametrize("n", [1, 5])
def test_complete(n):
    t = complete(n)
    _check_mixing(t)
    assert t.spectral_gap() == pytest.approx(1.0, abs=1e-12)
    assert t.neighbours(0) == list(range(1, n))


@pytest.mark.parametrize("n, degree", [(2, 1), (4, 3), (8, 5), (16, 7)])
def test_exponential(n, degree):
    t = exponential(n)
    _check_mixing(t)
    assert all(t.degree(i) == degree for i in range(n))  # i +- 1, 2, 4, ... (mod n), distinct
    assert t.weight(0, 1) == pytest.approx(1 / (degree + 1))


def test_spectral_gap_of_a_ring_matches_the_closed_form():
    # eigenvalues of the 1/3 ring: (1 + 2 cos(2 pi k / n)) / 3; the second largest modulus is k = 1
    for n in (5, 8, 16):
        expected = 1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3
        assert ring(n).spectral_gap() == pytest.approx(expected, abs=1e-12)
    assert ring(16).spectral_gap() < exponential(16).spectral_gap() < complete(16).spectral_gap()


def test_edges_are_listed_once():
    assert ring(4).edges() == [(0, 1), (0, 3), (1, 2), (2, 3)]


@pytest.mark.parametrize(
    "matrix, message",
    [
        ([[0.5, 0.5], [0.4, 0.6]], "must be symmetric: W\\[0,1\\] = 0.5 but W\\[1,0\\] = 0.4"),
        ([[0.5, 0.4], [0.4, 0.5]], "must be doubly stochastic: row 0 sums to 0.9"),
        ([[1, 0], [0, 1]], "must connect every worker: worker 1 cannot reach worker 0"),
        ([[1.5, -0.5], [-0.5, 1.5]], "must be non-negative"),
        ([[1, 0, 0]], "must be square"),
    ],
)
def test_bad_matrices_name_the_rule(matrix, message):
    with pytest.raises(ValueError, match=message):
        Topology(matrix)


def test_matrix_file(tmp_path):
    path = tmp_path / "w.txt"
    path.write_text("# a 3-ring\n1/3 placeholder\n")
    with pytest.raises(ValueError, match="w.txt:2: a mixing matrix row must hold numbers"):
        Topology.from_file(path)
    rows = ring(3).weights.tolist()
    path.write_text("# a 3-ring\n" + "\n".join(", ".join(repr(x) for x in r) for r in rows) + "\n")
    t = build_topology(str(path), 3)
    assert torch.equal(t.weights, ring(3).weights)
    with pytest.raises(ValueError, match="is for 3 workers, the run has 4"):
        build_topology(str(path), 4)
    path.write_text("0.5 0.5\n0.5\n")
    with pytest.raises(ValueError, match="must hold n rows of n numbers"):
        Topology.from_file(path)


def test_unknown_topology_and_bad_ranks():
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        build_topology("star", 4)
    with pytest.raises(ValueError, match="rank must be in \\[0, 4\\), got 4"):
        ring(4).neighbours(4)
