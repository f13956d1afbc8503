"""Checks of the stage-0 exercise (stage0_build.py): Eq. (2), the dependency score."""

import math

import numpy as np

import stage0_build


def score_by_hand():
    """Eq. (2) on hand-computed values, at the paper's weights and decay (§3.2) and at others."""
    assert math.isclose(float(stage0_build.dependency_score(0.5, 7, 7)), 0.7, rel_tol=1e-9)
    ten_back = float(stage0_build.dependency_score(0.0, 12, 2))  # §3.2: ten rounds back
    assert math.isclose(ten_back, 0.08925206405937193, rel_tol=1e-9)
    weighted = float(stage0_build.dependency_score(0.9, 5, 3, w_sem=0.5, w_dist=0.5, decay=0.2))
    assert math.isclose(weighted, 0.7851600230178197, rel_tol=1e-9)


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
    assert np.allclose(scores, [0.2489466210964059, 0.5550512606487094, 0.8842831905700232], rtol=1e-9)
