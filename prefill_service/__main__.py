"""`python -m prefill_service ...`: run one worker (see `prefill_service.main.main`)."""

from __future__ import annotations

import sys

from prefill_service.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
