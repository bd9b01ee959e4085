"""Built-in distribution policies (found by name through the ``msrl.policies`` entry points)."""
