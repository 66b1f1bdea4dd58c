"""Helpers shared by the test folders: fakes, the e2e stack harness, tiny models and engine
drivers, certificates. Imported as `tests.support.<module>`."""
