"""Internals every other layer builds on: the problem, batches, losses, argument checks, model inspection.

Nothing here is public API; see the README's "Development" section for the layout.
"""
