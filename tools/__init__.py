"""Investigation scripts, one-off GPU checks and their helpers: run from a checkout
(`python -m tools.probes.probe_ttft ...`), never installed with the package."""
