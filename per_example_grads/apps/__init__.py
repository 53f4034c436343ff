"""The applications built on the library: ``pegrad`` (``cli``), the demos, the diagnose command, the shared model zoo."""
