"""adaspec control (built by its own issue)."""
