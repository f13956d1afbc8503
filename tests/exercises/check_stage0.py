"""Checks of the stage-0 exercise (stage0_build.py): Eq. (2), the dependency score."""

import math

import numpy as np

import stage0_build


def score_by_hand():
    """Eq. (2) on hand-computed values: 0.6 * sim + 0.4 * exp(-0.15 * |t - i|)."""
    assert math.isclose(float(stage0_build.dependency_score(0.5, 7, 7)), 0.6 * 0.5 + 0.4, rel_tol=1e-9)
    # §3.2: ten rounds back the decay term is exp(-1.5) = 0.22
    ten_back = float(stage0_build.dependency_score(0.0, 12, 2))
    assert math.isclose(ten_back, 0.4 * math.exp(-1.5), rel_tol=1e-9)
    weighted = float(stage0_build.dependency_score(0.9, 5, 3, w_sem=0.5, w_dist=0.5, decay=0.2))
    assert math.isclose(weighted, 0.5 * 0.9 + 0.5 * math.exp(-0.4), rel_tol=1e-9)


def decay_reads_the_distance():
    """The decay reads the distance |t - i|: the same two rounds score the same in either order."""
    forward = float(stage0_build.dependency_score(0.3, 9, 4))
    backward = float(stage0_build.dependency_score(0.3, 4, 9))
    assert math.isclose(forward, backward, rel_tol=1e-12)
    assert forward < float(stage0_build.dependency_score(0.3, 9, 8))  # nearer rounds weigh more


def works_on_arrays():
    """The score works elementwise on numpy arrays (one query against its whole history at once)."""
    similarity = np.array([0.1, 0.5, 0.9])
    rounds = np.array([1, 3, 5])
    scores = np.asarray(stage0_build.dependency_score(similarity, 6, rounds))
    assert scores.shape == (3,)
    expected = 0.6 * similarity + 0.4 * np.exp(-0.15 * np.abs(6 - rounds))
    assert np.allclose(scores, expected, rtol=1e-9)
