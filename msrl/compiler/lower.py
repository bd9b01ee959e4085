"""Lowering: each fragment becomes the source of a pure Python function ``(state) -> (state, result)``.

Modes:
- ``scan``: every ``for range`` loop becomes ``jax.lax.scan`` over a body function whose carry is exactly
  what liveness says crosses iterations (component states written in the loop + loop-carried variables);
  the fragment is meant to be ``jax.jit``-ted whole.
- ``host``: for fragments that communicate or step host environments. Loops around such statements stay
  Python loops; every maximal run of jittable statements between them becomes its own jitted function of
  its live-in values, returning its live-out values. In such a loop, plain renames run in Python, and a
  loop's only ``buffer_insert`` is collected on the host and inserted once after it (``insert_batch``).
- ``python``: everything eager, loops as Python loops (the reference semantics, used in tests).
- ``probe``: like ``python`` but every loop runs once and every definition is recorded, for shape inference.

The generated source is kept (``Fragment.source``) and each of its lines maps back to the user's file:line,
so an error raised while tracing a fragment is reported at the user's statement.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import re
from typing import Any, Callable

from msrl.compiler.ir import Stmt, is_state, liveness, loop_defs, walk
from msrl.components import acting
from msrl.errors import CompileError, ConfigError, MsrlError, gist

STATE_PREFIX = "_s_"


def py(var: str) -> str:
    """The Python name of an IR variable (``@env`` -> ``_s_env``)."""
    return STATE_PREFIX + var[1:] if is_state(var) else var


def _is_rename(value: ast.expr) -> bool:
    """A plain name, attribute or tuple of them: moving references around, no computation."""
    if isinstance(value, ast.Name):
        return True
    if isinstance(value, ast.Attribute):
        return _is_rename(value.value)
    return isinstance(value, ast.Tuple) and all(_is_rename(e) for e in value.elts)


def _pack(names: list[str]) -> str:
    return "()" if not names else "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


@dataclasses.dataclass
class Lowered:
    name: str
    source: str
    filename: str
    linemap: dict[int, tuple[str, int, str]]  # generated line -> (user file, line, user source)
    fn: Callable | None = None


class _Emitter:
    def __init__(self, mode: str, derive_params: bool, shapes: dict, zeros: dict, host: frozenset[str] = frozenset()):
        self.mode, self.derive_params, self.shapes, self.zeros = mode, derive_params, shapes, zeros
        self.host = host  # components whose calls run on the host (never inside jit)
        self.lines: list[str] = []
        self.linemap: dict[int, tuple[str, int, str]] = {}
        self.live: dict[str, set[str]] = {}
        self.segments: _Emitter | None = None  # host mode: where the jitted segment functions go
        self.stacking: Stmt | None = None  # host mode: the buffer_insert of the current loop, collected

    def emit(self, indent: int, text: str, origin: Stmt | None = None) -> None:
        for i, line in enumerate(text.splitlines()):
            comment = f"  # {origin.file.rsplit('/', 1)[-1]}:{origin.line}" if origin is not None and i == 0 else ""
            self.lines.append("    " * indent + line + comment)
            if origin is not None:
                self.linemap[len(self.lines)] = (origin.file, origin.line, origin.source)

    def record(self, indent: int, s: Stmt, names: set[str]) -> None:
        names = sorted(n for n in names if not is_state(n))
        if self.mode == "probe" and names:
            self.emit(indent, f"_msrl_record({s.id!r}, {{{', '.join(f'{n!r}: {n}' for n in names)}}})")

    def record_in(self, indent: int, s: Stmt) -> None:
        """Probe mode: record the values a statement reads, before it runs (the row check traces it alone)."""
        method = s.kind == "api" and s.api.component in ("actor", "env")  # checked too, with its state
        names = sorted(py(n) for n in s.uses if method or not is_state(n))
        if self.mode == "probe" and names:
            self.emit(indent, f"_msrl_record_in({s.id!r}, {{{', '.join(f'{n!r}: {n}' for n in names)}}})", s)

    def block(self, stmts: list[Stmt], indent: int, defined: set[str]) -> None:
        if not stmts:
            self.emit(indent, "pass")
        if self.mode != "host":
            for s in stmts:
                getattr(self, "_" + s.kind)(s, indent, defined)
            return
        run: list[Stmt] = []  # host mode: maximal runs of jittable statements become jitted segments
        for s in stmts:
            if self._on_host(s):
                self._segment(run, indent, defined)
                run = []
                getattr(self, "_" + s.kind)(s, indent, defined)
            else:
                run.append(s)
        self._segment(run, indent, defined)

    def _needs_host(self, s: Stmt) -> bool:
        """Must run in Python: a send/recv, a host component's call, or a loop around one."""
        if s.kind == "loop":
            return any(self._needs_host(b) for b in s.body)
        return s.kind in ("send", "recv") or (s.kind == "api" and s.api.component in self.host)

    def _on_host(self, s: Stmt) -> bool:
        """Runs in Python here: what must, plus what costs nothing there (plain renames such as
        ``obs = next_obs`` or ``return metrics``) and the insert being collected, which would otherwise
        each cost a jitted call."""
        if self._needs_host(s) or s is self.stacking:
            return True
        value = s.node.value if s.kind == "compute" and isinstance(s.node, ast.Assign) else (
            s.node if s.kind == "return" else None)
        return value is not None and _is_rename(value)

    def _segment(self, run: list[Stmt], indent: int, defined: set[str]) -> None:
        """Emit ``run`` as a jitted function of its live-in values returning its live-out values."""
        if not run:
            return
        live_out = self.live[run[-1].id]
        used = {u for s in walk(run) for u in s.uses}
        # a loop's carry starts from its value outside the segment, if it has one (else from zeros)
        carried = {py(v) for s in walk(run) if s.kind == "loop" for v in loop_defs(s) & self.live[s.id + "/body"]}
        ins = sorted({py(v) for v in liveness(run, live_out, {}) & used} | (carried & defined))  # not pass-throughs
        defs = set().union(*(loop_defs(s) if s.kind == "loop" else set(s.defs) for s in run))
        outs = sorted(py(v) for v in defs & live_out)
        name = f"_seg_{run[0].id}"
        seg = self.segments
        seg.live = self.live
        seg.emit(0, f"def {name}({', '.join(ins)}):", run[0])
        seg.block(run, 1, set(ins))
        seg.emit(1, f"return {_pack(outs)}")
        # the buffer's old state is dead once the segment returns its new one: update it in place, not by
        # a copy. Not when the segment also returns the state's own arrays (buffer_get's batch, which may
        # still be on its way to another replica), nor for other states (a learner's broadcast parameters
        # are its state's arrays)
        gets = any(b.kind == "api" and b.api.name == "buffer_get" for b in walk(run))
        donate = ', donate_argnames="_s_buffer"' if "_s_buffer" in ins and "_s_buffer" in outs and not gets else ""
        seg.emit(0, f"{name} = _msrl_jit({name}{donate})")
        self.emit(indent, f"{_pack(outs)} = {name}({', '.join(ins)})", run[0])
        defined |= set(outs)

    def _api(self, s: Stmt, indent: int, defined: set[str]) -> None:
        self.record_in(indent, s)
        spec = s.api
        state = py("@" + spec.component)
        args = [state] + (["_s_params"] if "params" in spec.reads else [])
        args += [ast.unparse(a) for a in s.args] + [f"{k}={ast.unparse(v)}" for k, v in s.kwargs]
        method = f"_c_{spec.component}.{spec.method}"
        call = f"_msrl_acting({method}, {', '.join(args)})" if spec.name == "agent_act" else \
            f"{method}({', '.join(args)})"
        if self.mode == "probe" and spec.name == "env_step":  # what the loop hands the env, checked against its spec
            self.emit(indent, f"_msrl_check_actions({ast.unparse(s.args[0] if s.args else dict(s.kwargs)['action'])})",
                      s)
        if self.mode == "probe":  # the user's own methods, checked once
            call = f"_msrl_returned({spec.component!r}, {spec.method!r}, {state}, {call}, {spec.returns == 'None'})"
        target = ast.unparse(s.target) if s.target is not None else None
        if s is self.stacking:  # collected on the host, inserted once after the loop
            item = ast.unparse(s.args[0] if s.args else dict(s.kwargs)["item"])
            self.emit(indent, f"_items_{s.parent}.append({item})", s)
            if target:
                self.emit(indent, f"{target} = None")
        elif spec.returns == "None":
            self.emit(indent, f"{state} = {call}", s)
            if target:
                self.emit(indent, f"{target} = None")
        else:
            self.emit(indent, f"{state}, {target or '_'} = {call}", s)
        if "params" in spec.writes and self.derive_params:
            self.emit(indent, "_s_params = _c_learner.policy_params(_s_learner)")
        self.record(indent, s, s.defs)
        defined |= {py(d) for d in s.defs}

    def _compute(self, s: Stmt, indent: int, defined: set[str]) -> None:
        self.record_in(indent, s)
        self.emit(indent, ast.unparse(s.node), s)
        self.record(indent, s, s.defs)
        defined |= s.defs

    def _return(self, s: Stmt, indent: int, defined: set[str]) -> None:
        self.record_in(indent, s)
        self.emit(indent, f"_result = {ast.unparse(s.node)}", s)
        self.record(indent, s, s.defs)
        defined |= s.defs

    def _send(self, s: Stmt, indent: int, defined: set[str]) -> None:
        (var,) = s.uses
        self.emit(indent, f"_msrl_comm[{s.id!r}].send({py(var)})", s)

    def _recv(self, s: Stmt, indent: int, defined: set[str]) -> None:
        (var,) = s.defs
        self.emit(indent, f"{py(var)} = _msrl_comm[{s.id!r}].recv()", s)
        defined.add(py(var))

    def _loop(self, s: Stmt, indent: int, defined: set[str]) -> None:
        start, stop, step = s.range
        var = s.var if s.var and s.var != "_" else "_"
        if self.mode != "scan":
            bounds = f"range({start}, {stop}, {step})" + ("[:1]" if self.mode == "probe" else "")
            outer, self.stacking = self.stacking, self._stackable_insert(s) if self.mode == "host" else None
            if self.stacking is not None:
                self.emit(indent, f"_items_{s.id} = []")
            self.emit(indent, f"for {var} in {bounds}:", s)
            self.block(s.body, indent + 1, defined)
            if self.stacking is not None:
                self.segments.emit(0, f"_insert_{s.id} = _msrl_jit(_c_buffer.insert_batch, donate_argnums=0)")
                self.emit(indent, f"_s_buffer = _insert_{s.id}(_s_buffer, _msrl_stack(_items_{s.id}))", self.stacking)
            self.stacking = outer
            defined |= {py(d) for d in loop_defs(s)}
            return
        body_uses = {u for b in walk(s.body) for u in b.uses}
        carried = sorted(py(v) for v in loop_defs(s) & self.live[s.id + "/body"] if v != s.var)
        for name in carried:
            if name not in defined:  # first assigned inside the loop: start from zeros of its shape
                self.zeros[name] = self._shape_of(s, name)
                self.emit(indent, f"{name} = _msrl_zeros({name!r})", s)
        fn = f"_loop_{s.id}"
        self.emit(indent, f"def {fn}(_carry, {var if s.var in body_uses else '_'}):", s)
        if carried:
            self.emit(indent + 1, f"{_pack(carried)} = _carry")
        self.block(s.body, indent + 1, set(defined) | set(carried))
        self.emit(indent + 1, f"return {_pack(carried)}, None")
        xs = f"_msrl_arange({start}, {stop}, {step})" if s.var in body_uses else "None"
        self.emit(indent, f"{_pack(carried)}, _ = _msrl_scan({fn}, {_pack(carried)}, {xs}, length={s.trip_count})",
                  s)
        if s.var and s.var in self.live[s.id]:
            self.emit(indent, f"{s.var} = {range(*s.range)[-1]}", s)
        defined |= set(carried) | {py(d) for d in loop_defs(s)}

    @staticmethod
    def _stackable_insert(loop: Stmt) -> Stmt | None:
        """The loop's one ``buffer_insert``, if nothing else in the loop touches the buffer."""
        inserts = [b for b in loop.body if b.kind == "api" and b.api.name == "buffer_insert"]
        touching = [b for b in walk(loop.body) if "@buffer" in b.uses or "@buffer" in b.defs]
        return inserts[0] if len(inserts) == 1 and touching == inserts else None

    def _shape_of(self, loop: Stmt, name: str) -> Any:
        for b in reversed(list(walk(loop.body))):
            key = (b.id, name)
            if key in self.shapes:
                return self.shapes[key]
        raise CompileError(f"`{name}` is first assigned inside the loop and its shape is unknown", loop.file,
                           loop.line, f"assign `{name}` before the loop")


def generate(name: str, stmts: list[Stmt], state_keys: list[str], mode: str, derive_params: bool,
             returns: bool, shapes: dict | None = None, host: frozenset[str] = frozenset()) -> tuple[Lowered, dict]:
    """Source of fragment ``name`` over ``stmts`` (already projected onto the fragment)."""
    em = _Emitter(mode, derive_params, shapes or {}, {}, host)
    if mode == "host":
        em.segments = _Emitter("scan", derive_params, em.shapes, em.zeros)
    live_out = {"@" + k for k in state_keys} | ({"_result"} if returns else set())
    liveness(stmts, live_out, em.live)
    em.emit(0, f"def fragment_{name}(_state):")
    defined: set[str] = set()
    for k in state_keys:
        em.emit(1, f"{py('@' + k)} = _state[{k!r}]")
        defined.add(py("@" + k))
    if derive_params:
        em.emit(1, "_s_params = _c_learner.policy_params(_s_learner)")
        defined.add("_s_params")
    em.emit(1, "_result = None")
    em.block(stmts, 1, defined)
    em.emit(1, "return {" + ", ".join(f"{k!r}: {py('@' + k)}" for k in state_keys) + "}, _result")
    lines, linemap = em.lines, dict(em.linemap)
    if em.segments is not None:
        linemap.update({n + len(lines) + 1: where for n, where in em.segments.linemap.items()})
        lines = lines + [""] + em.segments.lines
    filename = f"<msrl fragment {name} ({mode})>"
    return Lowered(name, "\n".join(lines) + "\n", filename, linemap), em.zeros


def materialize(lowered: Lowered, namespace: dict[str, Any]) -> Callable:
    """Execute the generated source; keep it in linecache so tracebacks show it."""
    linecache.cache[lowered.filename] = (len(lowered.source), None, lowered.source.splitlines(True),
                                         lowered.filename)
    ns = {**namespace, "_msrl_acting": acting}
    exec(compile(lowered.source, lowered.filename, "exec"), ns)
    lowered.fn = ns[f"fragment_{lowered.name}"]
    return lowered.fn


def user_frames(exc: BaseException, lowered: list[Lowered]) -> tuple[tuple | None, tuple | None]:
    """The user's statement at which ``exc`` was raised while running generated code, and below it the deepest
    frame in the user's own code (a method it calls: ``(file, line, function)``; None: not the user's code,
    or raised at the statement itself). Raised at no statement: None, and the deepest frame in the user's code
    anywhere (a component's ``init``, say)."""
    import os
    import sysconfig

    libraries = {sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    libraries.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)  # msrl's core
    by_file = {lw.filename: lw for lw in lowered}
    found = inner = None
    tb = exc.__traceback__
    while tb is not None:
        file = tb.tb_frame.f_code.co_filename
        lw = by_file.get(file)
        if lw is not None and tb.tb_lineno in lw.linemap:
            found, inner = lw.linemap[tb.tb_lineno], None
        elif not (file.startswith("<") or "site-packages" in file or any(file.startswith(p) for p in libraries)):
            inner = (file, tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return found, inner


def reraise_at_user_line(exc: BaseException, lowered: list[Lowered], doing: str) -> None:
    """Re-raise an exception from generated code as a CompileError at the user's file:line (where a method
    the statement calls raised it in the user's own code: that line, naming the statement)."""
    frame, inner = user_frames(exc, lowered)
    if frame is None and inner is not None and not isinstance(exc, MsrlError):  # (a component's init, say)
        raise CompileError(f"{type(exc).__name__} in {inner[2]}() while {doing} the loop: {gist(str(exc))}", inner[0],
                           inner[1], "run `msrl ... --debug` to see the full traceback") \
            from exc.with_traceback(exc.__traceback__)
    if frame is None or (isinstance(exc, CompileError) and exc.file is not None) or isinstance(exc, ConfigError):
        raise exc
    file, line, source = frame
    if isinstance(exc, CompileError):  # raised by msrl itself while running the user's statement
        raise CompileError(exc.reason, file, line, exc.hint) from None
    first = gist(str(exc))
    import jax

    hint = None
    converts = re.search(r"with the `(float|complex)` function", str(exc))
    if isinstance(exc, jax.errors.ConcretizationTypeError) and converts:
        hint = ("float(x) needs a value known at compile time; this one is computed when the program runs: keep the "
                "array (a metric's array is logged as a number; x.astype(jnp.float32) converts its dtype)")
    elif isinstance(exc, (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)):
        hint = ("a Python `if`, `and`/`or`, `x if c else y` or `int(x)` needs a value known at compile time; this one "
                "is computed when the program runs (what an API call returns and what is made from it; inside `for "
                "i in range(N)` over API calls, `i` too: the loop runs as lax.scan): select with jnp.where, or write "
                "a loop's special iteration out before the loop")
    if inner is not None and inner[:2] != (file, line):
        at = f"{file.rsplit('/', 1)[-1]}:{line}"
        raise CompileError(f"{type(exc).__name__} in {inner[2]}() while {doing} `{source}` ({at}): {first}",
                           inner[0], inner[1], hint or "run `msrl ... --debug` to see the full traceback") \
            from exc.with_traceback(exc.__traceback__)
    what = "JAX error" if type(exc).__module__.startswith("jax") else "traceback"
    raise CompileError(f"{type(exc).__name__} while {doing} `{source}`: {first}", file, line,
                       hint or f"run `msrl ... --debug` to see the full {what}") \
        from exc.with_traceback(exc.__traceback__)
