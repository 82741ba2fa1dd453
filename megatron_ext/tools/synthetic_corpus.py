"""A synthetic corpus over a whole vocabulary: token ids drawn from a Zipf law, offline, in seconds,
the same for the same seed (``python -m megatron_ext.tools.data_prep --source zipf``).

Real BPE text is Zipfian over its vocabulary (frequency of the ``r``-th most frequent id about
``r^-s``; this package's own BPE text corpus, ``data_prep --source text``, fits ``s`` = 1.07 over
its ranks 10-5,000). The text corpus that ships offline has an 8,192-id tokenizer, so a model
with the Llama-3 vocabulary (128,256 ids) never sees 94% of its rows, and a 10% STEM GPU tier
holds every row the data touches. This corpus draws every id of the vocabulary instead, so that
what depends on the id distribution alone (which rows are hot, how many tokens a GPU tier of
a given size serves, the rows a batch touches) is realistic. What it is not: text. Ids are drawn
independently, so nothing in it can be learnt beyond the unigram frequencies (a loss curve says
nothing about a model), and a batch touches more distinct ids than real text, which repeats ids
within a document (docs/scaling.md: 1,842 distinct ids per 16,384 tokens of the BPE text corpus,
3,420 once its tokens are shuffled).

Layout: id 0 is the end-of-document token (as in the text corpus); ids ``1..V-1`` take the Zipf
ranks ``1..V-1`` through a seeded permutation, so that the frequent ids are not the low ones (no
code may profit from id order); documents have geometric lengths of mean ``DOC_TOKENS``, each
ended by id 0.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import numpy
from tokenizers import Tokenizer, models, pre_tokenizers

DOC_TOKENS = 1024  # mean document length in tokens, the end-of-document token included


def zipf_probabilities(ids: int, exponent: float) -> numpy.ndarray:
    """``p[r - 1]`` proportional to ``r^-exponent`` for the ranks ``r = 1..ids`` (float64, sum 1)."""
    p = numpy.arange(1, ids + 1, dtype=numpy.float64) ** -exponent
    return p / p.sum()


def zipf_tokens(vocab: int, exponent: float, tokens: int, seed: int
                ) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """``(ids, document lengths)``: ``tokens`` ids (int64) in documents whose last id is 0, the
    others drawn independently from the Zipf law over ``1..vocab-1`` (rank to id through a
    seeded permutation). The same arguments give the same arrays."""
    rng = numpy.random.Generator(numpy.random.PCG64(seed))
    rank_to_id = rng.permutation(numpy.arange(1, vocab, dtype=numpy.int64))
    lengths = []
    total = 0
    while total < tokens:  # geometric lengths (>= 1: the end-of-document token)
        drawn = rng.geometric(1.0 / DOC_TOKENS, size=max(16, (tokens - total) // DOC_TOKENS + 16))
        for n in drawn:
            n = int(min(n, tokens - total))
            lengths.append(n)
            total += n
            if total == tokens:
                break
    lengths = numpy.asarray(lengths, dtype=numpy.int64)
    # Independent draws, made as a multinomial count per rank laid out in a random order: the
    # same distribution as one draw per token, without a search per token (seconds, not a minute).
    words = tokens - len(lengths)
    counts = rng.multinomial(words, zipf_probabilities(vocab - 1, exponent))
    stream = numpy.repeat(rank_to_id, counts)
    rng.shuffle(stream)
    ids = numpy.zeros(tokens, dtype=numpy.int64)
    ends = numpy.cumsum(lengths) - 1
    body = numpy.ones(tokens, dtype=bool)
    body[ends] = False
    ids[body] = stream
    return ids, lengths


def documents(ids: numpy.ndarray, lengths: numpy.ndarray) -> Iterator[numpy.ndarray]:
    start = 0
    for n in lengths:
        yield ids[start:start + int(n)]
        start += int(n)


def word_tokenizer(vocab: int, eod_token: str) -> Tokenizer:
    """A tokenizer with exactly ``vocab`` ids for the synthetic corpus: ``eod_token`` is id 0, id
    ``i`` the word ``t<i>`` (whitespace-separated), so that Megatron's ``HuggingFaceTokenizer``
    loads it with the vocabulary the data spans."""
    words = {eod_token: 0, **{f"t{i}": i for i in range(1, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token=eod_token))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer
