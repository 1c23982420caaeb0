"""``python -m metadispatch``: the command line (``metadispatch/cli/``)."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
