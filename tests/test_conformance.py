"""A fast slice of the conformance matrix (``python -m msrl.conformance`` runs all of it): threads and jax
only, the SAC-shaped and the recurrent test loops and A2C under ``single_learner_coarse`` and ``async``. No cell may be
SILENTLY DIFFERENT or an ERROR, and the SAC-shaped loop, whose replay buffer is local and whose learner
has several optimizers and target networks, must be either refused with a clear message or equal to fused
under both."""

from __future__ import annotations

import pytest

from msrl import conformance
from msrl.conformance import DESIGN, EQUAL, FAILURES, REFUSED


@pytest.fixture(scope="module")
def cells():
    sac, _ = conformance.run_matrix(["sac"], ["coarse/threads", "async-w1/threads", "async-w2/threads"],
                                    ray=False, devices=False, log=lambda msg: None)
    rest, _ = conformance.run_matrix(["a2c", "recurrent"], ["coarse/threads", "async-w1/threads"], ray=False,
                                     devices=False, log=lambda msg: None)
    return {(c.loop, c.column): c for c in sac + rest}


def test_no_cell_is_silently_different_or_an_error(cells):
    bad = [f"{c.loop} × {c.column}: {c.verdict} — {c.detail}" for c in cells.values() if c.verdict in FAILURES]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("column", ["coarse/threads", "async-w1/threads", "async-w2/threads"])
def test_sac_shaped_loop_is_refused_clearly_or_equal_to_fused(cells, column):
    cell = cells[("sac", column)]
    if cell.verdict == REFUSED:
        assert not cell.unclear, f"unclear refusal ({cell.unclear}): {cell.detail}"
        assert "Error at " in cell.detail and len(cell.detail) > 40, cell.detail
    elif column == "async-w2/threads":
        assert cell.verdict == DESIGN, cell.detail
    else:
        assert cell.verdict == EQUAL, cell.detail


@pytest.mark.parametrize("loop", ["a2c", "recurrent"])
def test_equal_to_fused_under_coarse_and_one_async_worker(cells, loop):
    """A2C, and the GRU actor whose hidden state lives in the actor replicas' state."""
    for column in ("coarse/threads", "async-w1/threads"):
        assert cells[(loop, column)].verdict == EQUAL, cells[(loop, column)].detail


def test_verdicts_of_made_up_outcomes():
    """The judge itself: equal within the tolerance, a difference where equality is promised, a by-design run
    that did not train, and a refusal whose message shows internals."""
    import numpy as np

    col, design = conformance.COLUMN["coarse/threads"], conformance.COLUMN["multi-l2/jax"]
    rows = [{"episodes": 0.0}, {"episodes": 2.0}]
    ref = conformance.Outcome("ok", {"w": np.zeros(3)}, {"w": np.ones(3)}, rows)
    near = conformance.Outcome("ok", {"w": np.zeros(3)}, {"w": np.ones(3) + 1e-6}, rows)
    far = conformance.Outcome("ok", {"w": np.zeros(3)}, {"w": np.ones(3) + 1e-2}, rows)
    nan = conformance.Outcome("ok", {"w": np.zeros(3)}, {"w": np.full(3, np.nan)}, rows)
    other_eps = conformance.Outcome("ok", {"w": np.zeros(3)}, {"w": np.ones(3)}, [{"episodes": 0.0}, {"episodes": 1.0}])
    assert conformance.verdict(ref, ref, col)[:2] == (EQUAL, "bitwise")
    assert conformance.verdict(ref, near, col)[0] == EQUAL
    assert conformance.verdict(ref, far, col)[0] == conformance.SILENT
    assert conformance.verdict(ref, nan, col)[0] == conformance.SILENT
    assert conformance.verdict(ref, other_eps, col)[0] == conformance.SILENT
    # the policy's parameters equal, the learner's other state (an optimizer moment, a target network) not
    ref.learner, near.learner = [np.ones(3), np.zeros(3)], [np.ones(3), np.full(3, 0.5)]
    assert conformance.verdict(ref, near, col)[0] == conformance.SILENT
    assert "learner's state" in conformance.verdict(ref, near, col)[1]
    same = conformance.Outcome("ok", {"w": np.zeros(3)}, {"w": np.ones(3)}, rows,
                               learner=[np.ones(3), 1e-6 + np.zeros(3)])
    assert conformance.verdict(ref, same, col)[:2] == (EQUAL, "≤ tol (max diff 0 after 3 iterations; the learner's "
                                                               "state within 1e-06)")  # (it said "bitwise")
    assert conformance.verdict(ref, far, design)[0] == DESIGN
    stuck = conformance.Outcome("ok", {"w": np.ones(3)}, {"w": np.ones(3)}, rows)
    assert conformance.verdict(ref, stuck, design)[0] == conformance.SILENT
    refusal = conformance.Outcome("refused", exc_type="CompileError", message="loop.py:3: joins `_api1` from ...",
                                  phase="build", file="loop.py")
    assert conformance.verdict(None, refusal, col)[0] == REFUSED
    assert "internals" in conformance.verdict(None, refusal, col)[2]
    crash = conformance.Outcome("error", exc_type="KeyError", message="'x'", phase="run")
    assert conformance.verdict(None, crash, col)[0] == conformance.ERROR


@pytest.mark.parametrize("argv, error", [
    (["--only", "a2c", "--columns", "coarse/threads", "--k", "0"], "--k: iterations per cell must be a whole number "
                                                                   ">= 1, got 0"),  # (was judged bitwise)
    (["--only", "a2c", "--columns", "coarse/ray", "--no-ray"], "no cell to run: the columns asked for (coarse/ray) "
                                                               "are Ray or JAX-devices cells"),  # (was an empty report)
])
def test_options_that_judge_nothing_are_refused(argv, error, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        conformance.main([*argv, "--out", str(tmp_path / "report.md")])
    assert info.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()
