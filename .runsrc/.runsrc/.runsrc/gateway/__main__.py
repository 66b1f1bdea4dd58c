"""`python -m gateway ...`: run the gateway (see `gateway.server.main`)."""

from __future__ import annotations

import sys

from gateway.server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
