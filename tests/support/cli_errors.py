"""The CLI's contract for bad input, shared by the CLI tests: exit status 2 and one line on stderr."""
from jaxspec import cli


def one_line_error(capsys, *argv) -> str:
    """Run `cli.main(argv)`; assert exit status 2 and a single `jaxspec: error: ...` line; return it."""
    rc = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxspec: error: "), err
    return err
