"""The one exception of zoo.data."""


class DataError(ValueError):
    """Bad data input, in one line: `<key>: <what is wrong, naming the file>; <fix>`.

    The key is the config key to change (`data.path`, `data.tokenizer`, `data.text_field`, `data.seq_len`,
    `data.batch_size`, `model.vocab_size`), as in train.py's configuration errors.
    """
