"""Imported by the feature matrix's worker processes (a case's "import" in tests/parallel_worker.py):
registers the matrix flavors there, for the whole (short-lived) process."""

from tests.feature_matrix import register_flavors

register_flavors()
