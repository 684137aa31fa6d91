"""adaspec engine: the model runtime and the speculative loop."""
