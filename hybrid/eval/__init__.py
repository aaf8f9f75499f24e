"""Long-context recall evaluation: task generators (and, later, scoring and the runner)."""
