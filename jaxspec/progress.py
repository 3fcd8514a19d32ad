"""Progress bars for long work (a conversion, training, a benchmark sweep): tqdm on stderr.

A bar is shown only where someone watches: `enabled=None` (the default of the command-line tools)
means "stderr is a terminal", so a redirected or piped run (`... 2>log`, `... | jq`) gets no bar
characters in its files, and stdout never gets any. `enabled=False` (a `--quiet` flag, or library
code nobody asked for a bar) turns it off; `enabled=True` shows it on any stderr. Library functions
take a `progress=` argument and show nothing unless asked."""
from __future__ import annotations

import contextlib
import sys


def wanted(enabled: bool | None = None) -> bool:
    """Whether a bar would be shown: `enabled` if given, else whether stderr is a terminal. With
    stderr closed (sys.stderr None) never: tqdm would otherwise fall back to stdout."""
    err = sys.stderr
    if err is None:
        return False
    if enabled is not None:
        return bool(enabled)
    try:
        return err.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class _Off:
    """What `bar` returns when no bar is shown: the calls a caller makes, doing nothing."""

    def __init__(self, iterable=None, total=None):
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, s="", refresh=True):
        pass

    def set_description_str(self, s="", refresh=True):
        pass

    def close(self):
        pass

    def external_write_mode(self):
        return contextlib.nullcontext()


def bar(iterable=None, *, total=None, desc: str = "", unit: str = "it", enabled: bool | None = None,
        leave: bool = False, **kw):
    """A tqdm bar on stderr over `iterable` (or updated by hand: `.update(n)`), or a stand-in doing
    nothing when `wanted(enabled)` is false. `leave=False`: the bar is erased when done, so the
    notes and results printed after it stay readable."""
    if not wanted(enabled):
        return _Off(iterable, total)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True, **kw)


@contextlib.contextmanager
def tracking(desc: str, *, enabled: bool | None = None, unit: str = "B"):
    """A bar driven by a library's `progress(done, total)` callback (e.g. `models.load_gguf_target`,
    whose totals are bytes): yields that callback, closes the bar at the end."""
    with bar(desc=desc, unit=unit, unit_scale=unit == "B", enabled=enabled) as b:
        def tick(done: int, total: int) -> None:
            if b.total != total:
                b.total = total
            b.update(done - b.n)

        yield tick
