"""Shared by the tests (moved from tests/serve/test_serve_guard.py: no test module imports another)."""
import socket
import time
from jaxspec import cli
from jaxspec.engine import memory as serve_memory


def serve_fails(capsys, *argv) -> str:
    t0 = time.monotonic()
    rc = cli.main(["serve", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxspec: "), err
    assert time.monotonic() - t0 < 10
    return err


def memory_of(monkeypatch, total: int, label: str) -> str:
    """`serve` sees `total` bytes of `label` and must stop before loading a model; a free port (so that
    only the memory can stop it)."""
    def reached(*a, **kw):
        raise AssertionError("a model was about to be loaded")
    monkeypatch.setattr(cli, "_load_pair", reached)
    monkeypatch.setattr(cli, "device_memory", lambda: (total, label))
    monkeypatch.setattr(serve_memory, "cgroup_limit", lambda: None)  # the machine's own, whatever runs beside
    monkeypatch.setattr(serve_memory, "available_now", lambda: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
