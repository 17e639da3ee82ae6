"""The one-line errors that every layer of Zoo raises for bad input, at the bottom of the import graph
so that config groups defined beside their code (`zoo.lora.LoraConfig`, `zoo.offload.OffloadConfig`)
raise them without importing the training package that catches them, and a family's config.json reader
(`zoo/families/<name>.py`) without importing the checkpoint loader (`zoo.hf`)."""


class ConfigError(ValueError):
    """One line: `<key>: <what is wrong>; <fix>`."""


class CheckpointError(ValueError):
    """A checkpoint directory, config or tensor that cannot be used; the message names it."""
