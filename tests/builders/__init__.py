"""Fixture builders (dev-only): random checkpoints in the layouts users arrive with.

Imported by the tests as `builders` (pytest puts tests/ on sys.path) and by
the developer scripts in scripts/.
"""
