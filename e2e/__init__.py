"""Real-cluster end-to-end harness (see docs/e2e.md)."""
