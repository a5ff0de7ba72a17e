"""``python -m engine``: the same command line as ``engine``."""

from .cli import main

main()
