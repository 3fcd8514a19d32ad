"""A stand-in for a user's terminal as stderr, for the progress bars (jaxspec.progress shows them
only on a terminal)."""
import io


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (isatty), keeping what was written."""

    def isatty(self):
        return True
