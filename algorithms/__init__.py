"""Built-in algorithms (found by name through the ``msrl.algorithms`` entry points)."""
