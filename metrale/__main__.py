"""``python -m metrale``: the ``metrale`` command (:func:`metrale.entrypoints.cli.main`)."""

import sys

from metrale.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
