"""Training data from real text: read a file or folder, tokenize (bytes or a tokenizer.json), pack into
fixed-length windows, shuffle, split across data-parallel processes, resume at any step (see pipeline.py).

    data = load_text("my_corpus/", seq_len=256, batch_size=32, vocab_size=256,
                     process_index=jax.process_index(), process_count=jax.process_count())
    for step in range(start, steps):
        tokens = data.batch(step)   # int32 [32 / process_count, 256], this process's rows of step's batch
"""

from zoo.data.errors import DataError
from zoo.data.pipeline import SHIPPED_CORPUS, TextData, from_config, load_text, unigram_entropy
from zoo.data.text import Corpus, read_corpus
from zoo.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer

__all__ = [
    "SHIPPED_CORPUS", "ByteTokenizer", "Corpus", "DataError", "HFTokenizer", "TextData", "check_vocab",
    "from_config", "load_text", "load_tokenizer", "read_corpus", "unigram_entropy",
]
