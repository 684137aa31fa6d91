"""adaspec daemon (built by its own issue)."""
