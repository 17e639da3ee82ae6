"""Training data from real text: read a file or folder (plain text, prompt/response pairs, chats),
tokenize (bytes or a tokenizer.json), pack into fixed-length windows with segment ids, positions and a
loss mask, hold out an eval split, shuffle, split across data-parallel processes, resume at any step
(see pipeline.py).

    data = load_text("my_corpus/", seq_len=256, batch_size=32, vocab_size=256, eval_fraction=0.05,
                     process_index=jax.process_index(), process_count=jax.process_count())
    for step in range(start, steps):
        # {"tokens", "segment_ids", "positions", "loss_mask"}: int32 [32 / process_count, 256]
        batch = data.batch(step)
    data.eval.batch(0)  # the held-out split's first batch
"""

from zoo.data.errors import DataError
from zoo.data.pipeline import BATCH_FIELDS, SHIPPED_CORPUS, TextData, from_config, load_text, unigram_entropy
from zoo.data.text import Chat, Corpus, PromptResponse, read_corpus
from zoo.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer

__all__ = [
    "BATCH_FIELDS",
    "SHIPPED_CORPUS",
    "ByteTokenizer",
    "Chat",
    "Corpus",
    "DataError",
    "HFTokenizer",
    "PromptResponse",
    "TextData",
    "check_vocab",
    "from_config",
    "load_text",
    "load_tokenizer",
    "read_corpus",
    "unigram_entropy",
]
