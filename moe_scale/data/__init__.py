"""Data: the embedded default corpus, the word vocabulary, text loading (HF datasets), LM batching."""

from moe_scale.data.batches import LMWindows
from moe_scale.data.embedded import EMBEDDED_NAME, embedded_corpus_dir, generate_embedded_corpus
from moe_scale.data.text import (holdout_split, load_sentences, load_splits, resolve_text_files, sentence_texts,
                                 split_files)
from moe_scale.data.vocab import Vocab, unigram_perplexity

__all__ = ["EMBEDDED_NAME", "LMWindows", "Vocab", "embedded_corpus_dir", "generate_embedded_corpus",
           "holdout_split", "load_sentences", "load_splits", "resolve_text_files", "sentence_texts", "split_files",
           "unigram_perplexity"]
