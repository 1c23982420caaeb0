"""``python -m metadispatch``: the command line (``metadispatch/cli/``)."""

from .cli.main import console

if __name__ == "__main__":
    raise SystemExit(console())
