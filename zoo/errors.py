"""The one-line error that every layer of Zoo raises for bad input, at the bottom of the import graph
so that config groups defined beside their code (`zoo.lora.LoraConfig`, `zoo.offload.OffloadConfig`)
raise it without importing the training package that catches it."""


class ConfigError(ValueError):
    """One line: `<key>: <what is wrong>; <fix>`."""
