"""The environment of `make demo-agent` (deploy/configs/local-agent.toml), a TRL-style environment class: one
safe per episode, whose code (one character: a letter or a digit) is in the dataset row and nowhere in the prompt. The only way to learn
it is the tool, ``read_note``; the answer is then scored by ``exact_match`` against the row's ``answer``."""


class Safe:
    """One safe per episode: ``reset`` is given the dataset row (TRL's ``environment_factory`` contract)."""

    def __init__(self):
        self.code = None

    def reset(self, code, **row):
        self.code = code

    def read_note(self) -> str:
        """Read the note taped under the safe, which holds its code."""
        return self.code
