"""Entry point of the persist worker process (see :mod:`storage.checkpoint.persist._child`)."""

import sys

from storage.checkpoint.persist._child import main

main(int(sys.argv[1]))
