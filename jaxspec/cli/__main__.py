"""`python -m jaxspec.cli` runs the CLI as `python -m jaxspec` does."""
import sys

from jaxspec.cli import main

sys.exit(main())
