"""The backend contract: turn a compiled :class:`~msrl.compiler.Program` into a running :class:`Runtime`."""

from __future__ import annotations

from typing import Any, Iterator


class Runtime:
    """A running program. ``run(n)`` performs ``n`` training iterations and returns one metrics dict per
    iteration (``episode_return``, ``episodes`` and the loop's own metrics, as Python floats)."""

    compile_seconds: float | None = None  # XLA compile time ahead of the run; None: compiled lazily in it

    def run(self, iterations: int) -> list[dict[str, float]]:
        raise NotImplementedError

    def stream(self, iterations: int, chunk: int) -> Iterator[list[dict[str, float]]]:
        """Run ``iterations`` iterations, yielding the rows of every ``chunk`` of them as they finish
        (a backend may start the next chunk before the caller has read the last one)."""
        while iterations > 0:
            n = min(chunk, iterations)
            yield self.run(n)
            iterations -= n

    def state(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Backend:
    """Subclass and register with ``@msrl.register_backend(name)`` (or the ``msrl.backends`` entry points)."""

    def build(self, program: Any, seed: int, iterations_per_dispatch: int) -> Runtime:
        raise NotImplementedError


def result_metrics(result: Any) -> dict[str, float]:
    """One iteration's loop result as floats (a dict of scalars as is; arrays are averaged)."""
    import numpy as np

    if result is None:
        return {}
    out = {}
    for k, v in result.items() if isinstance(result, dict) else [("result", result)]:
        try:
            out[str(k)] = float(np.mean(np.asarray(v)))
        except (TypeError, ValueError):
            continue
    return out


def metric_rows(train: Any, env: dict[str, Any], n: int) -> list[dict[str, float]]:
    """Per-iteration rows from stacked (leading axis = iteration) loop results and env statistics."""
    import jax

    from msrl.components import episode_metrics

    return [{**episode_metrics([{k: v[i] for k, v in env.items()}]),
             **result_metrics(jax.tree.map(lambda x: x[i], train))} for i in range(n)]
