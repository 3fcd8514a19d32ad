"""A stand-in target for the input checks: a config and nothing else (moved from
tests/engine/test_knobs.py: no test module imports another)."""
import types

CONTEXT = 256


class NoModel:
    """A target with a config and nothing else: any use past the input checks raises."""

    def __init__(self, context=CONTEXT):
        self.config = types.SimpleNamespace(vocab_size=512, max_position_embeddings=context)

    def __getattr__(self, name):
        raise AssertionError(f"the model was used ({name}) before the input was refused")
