"""The compiler's intermediate representation: a tree of statements.

A training loop becomes a list of :class:`Stmt`: API call sites, the plain compute statements between them,
static ``for … in range`` loops (with a body), and the final return. Every statement knows the user's
file:line it came from, the variables it defines and uses, and the component states it reads and writes
(as pseudo-variables ``@env``, ``@actor``, ``@learner``, ``@buffer`` and ``@params``, so that one
def-use analysis covers data and state alike).
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Iterator

from msrl.api import ApiSpec


@dataclasses.dataclass(eq=False)
class Stmt:
    id: str
    kind: str  # "api" | "compute" | "loop" | "return"
    file: str
    line: int
    source: str  # the user's source text of the statement, for comments and graphs
    defs: frozenset[str] = frozenset()
    uses: frozenset[str] = frozenset()
    # api
    api: ApiSpec | None = None
    target: ast.expr | None = None  # where the result goes (None: discarded)
    args: tuple[ast.expr, ...] = ()
    kwargs: tuple[tuple[str, ast.expr], ...] = ()
    # compute / return
    node: ast.stmt | ast.expr | None = None
    # loop
    var: str | None = None
    range: tuple[int, int, int] | None = None
    body: list["Stmt"] = dataclasses.field(default_factory=list)
    parent: str | None = None  # enclosing loop id

    @property
    def trip_count(self) -> int:
        return len(range(*self.range)) if self.range else 1

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def state_var(component: str) -> str:
    return "@" + component


def is_state(name: str) -> bool:
    return name.startswith("@")


def walk(stmts: list[Stmt]) -> Iterator[Stmt]:
    """Every statement, loops before their bodies, in program order."""
    for s in stmts:
        yield s
        if s.kind == "loop":
            yield from walk(s.body)


def leaves(stmts: list[Stmt]) -> Iterator[Stmt]:
    return (s for s in walk(stmts) if s.kind != "loop")


def loop_defs(loop: Stmt) -> set[str]:
    out = {loop.var} if loop.var else set()
    for s in walk(loop.body):
        out |= s.defs
    return out


def liveness(stmts: list[Stmt], live_out: set[str], result: dict[str, set[str]]) -> set[str]:
    """Backward liveness. Fills ``result[stmt.id]`` with what is live *after* each statement (for a loop:
    after the loop; for its body, ``result[loop.id + '/body']`` is what is live at the end of an iteration).
    Returns what is live before ``stmts``."""
    live = set(live_out)
    for s in reversed(stmts):
        result[s.id] = set(live)
        if s.kind == "loop":
            # trip counts are static and >= 1, so the body runs at least once; iterate to the fixed point
            end = set(live)
            while True:
                start = liveness(s.body, end, result)
                start.discard(s.var)
                new_end = end | start
                if new_end == end:
                    break
                end = new_end
            result[s.id + "/body"] = end
            live = start
        else:
            live = (live - s.defs) | s.uses
    return live
