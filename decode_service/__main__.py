"""`python -m decode_service ...`: run one worker (see `decode_service.main.main`)."""

from __future__ import annotations

import sys

from decode_service.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
