"""Front end: read a training loop's source and build the IR.

What it accepts: assignments and expressions, API calls anywhere an expression may stand (they are hoisted
into temporaries in evaluation order), static ``for x in range(...)`` loops (nested too), ``if`` on a
condition known at compile time, calls of helper methods of the algorithm (inlined when they contain API
calls), and one ``return`` at the end. Everything else that touches the API is a :class:`CompileError`
naming the user's file:line and what to write instead.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import itertools
import random
import textwrap
import time
import warnings
from typing import Any, Callable

from msrl.api import API, ApiSpec, api_spec
from msrl.compiler.ir import Stmt, leaves, state_var, walk
from msrl.errors import CompileError, defined_at, did_you_mean

RESERVED_PREFIXES = ("_s_", "_c_", "_api", "_h", "_msrl")
_STATIC_TYPES = (int, float, bool, str, type(None), tuple)
_PURE_BUILTINS = {"int", "float", "bool", "len", "min", "max", "abs", "round", "tuple", "range"}


_NESTED_SCOPES = (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ListComp, ast.SetComp,
                  ast.DictComp, ast.GeneratorExp)


def _scope_walk(node: ast.AST):
    """Like ``ast.walk``, but the variables of a nested scope (comprehension, lambda, def, class) stay
    inside it: from one, only what it shares with the enclosing scope is yielded. That is the parts
    evaluated outside it (a comprehension's first iterable, defaults, decorators, bases), the name a def or
    class binds, walrus targets in comprehensions and ``nonlocal`` names (as stores), and its free
    variables (as loads). ``node`` itself, if a def, is the scope walked (its body)."""
    todo = list(node.body) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else [node]
    while todo:
        n = todo.pop(0)
        if not isinstance(n, _NESTED_SCOPES):
            yield n
            todo.extend(ast.iter_child_nodes(n))
            continue
        inner: list[ast.AST] = []
        if isinstance(n, ast.Lambda):
            todo += n.args.defaults + [d for d in n.args.kw_defaults if d is not None]
            inner, bound = [n.body], {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield ast.Name(n.name, ast.Store())
            todo += n.decorator_list
            if isinstance(n, ast.ClassDef):
                todo += n.bases + [k.value for k in n.keywords]
                bound = set()
            else:
                todo += n.args.defaults + [d for d in n.args.kw_defaults if d is not None]
                bound = {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
            inner = n.body
            for s in inner:
                for m in ast.walk(s):
                    if isinstance(m, ast.Nonlocal):
                        for name in m.names:
                            yield ast.Name(name, ast.Store())
        else:  # comprehension
            first, *rest = n.generators
            todo.append(first.iter)
            inner = [first.target, *(c for g in rest for c in (g.target, g.iter)), *(i for g in n.generators
                     for i in g.ifs), *((n.key, n.value) if isinstance(n, ast.DictComp) else (n.elt,))]
            bound = set()
            for m in (m for c in inner for m in ast.walk(c)):
                if isinstance(m, ast.NamedExpr):
                    yield m.target  # binds in the enclosing scope
        names = [m for c in inner for m in ast.walk(c) if isinstance(m, ast.Name)]
        bound |= {m.id for m in names if not isinstance(m.ctx, ast.Load)}
        yield from (ast.Name(m.id, ast.Load()) for m in names if isinstance(m.ctx, ast.Load) and m.id not in bound)


_UNRESOLVED = object()


def _named(expr: ast.expr, scope: dict[str, Any]) -> Any:
    """The object a Name/Attribute chain (``np.random.rand``, ``self.rng.random``) names in ``scope``, else
    ``_UNRESOLVED``."""
    chain = []
    while isinstance(expr, ast.Attribute):
        chain.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in scope:
        return _UNRESOLVED
    value = scope[expr.id]
    try:
        for attr in reversed(chain):
            value = getattr(value, attr)
    except Exception:  # noqa: BLE001 - not resolvable here: not judged
        return _UNRESOLVED
    return value


def trace_time_call(node: ast.AST, scope: dict[str, Any]) -> str | None:
    """``np.random.rand()``, ``random.random()``, ``time.time()``, a draw of a generator or ``next()`` of an iterator
    kept on ``self`` or a global (``self.rng.random()``, ``next(self.counter)``)... where ``node`` calls one: code
    whose result a trace fixes (the same number every iteration, and another by how often a policy traces).
    None for anything else."""
    if not isinstance(node, ast.Call):
        return None
    value = _named(node.func, scope)
    if value is next and node.args and hasattr(_named(node.args[0], scope), "__next__"):
        return f"`next({ast.unparse(node.args[0])})`"
    if value is _UNRESOLVED:
        return None
    owner = getattr(value, "__self__", None)
    module = getattr(value, "__module__", None) or (type(owner).__module__ if owner is not None else "") or ""
    if module.startswith("numpy.random") or module == "random" or isinstance(owner, random.Random) or \
            value in (time.time, time.time_ns, time.perf_counter, time.monotonic) or \
            (owner is not None and getattr(value, "__name__", None) == "__next__"):
        return f"`{ast.unparse(node.func)}()`"
    return None


def check_traced_calls(root: ast.AST, scope: dict[str, Any], file: str, line: Callable[[ast.AST], int], what: str,
                       traced: str, each: str, hint: str, seen: set | None = None) -> None:
    """Code that JAX traces (``what``, the function ``root``, whose global names, and ``self``, mean what ``scope``
    says) calls no :func:`trace_time_call` (a CompileError at its line); a ``print()`` in it is a warning: both run
    only while ``traced``, not every ``each``. ``seen``: the lines already judged (a statement inside another)."""
    for node in ast.walk(root):
        if seen is not None and isinstance(node, ast.Call):
            if (line(node), node.col_offset) in seen:
                continue
            seen.add((line(node), node.col_offset))
        once = trace_time_call(node, scope)
        if once:
            raise CompileError(f"{once} in {what} runs once, while {traced}, not every {each}: its value is a "
                               "constant of the compiled program", file, line(node), hint)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            warnings.warn_explicit(f"print() in {what} runs only while {traced} (a few times, before training), not "
                                   f"every {each}; use jax.debug.print(...) to print values as it runs", UserWarning,
                                   file, line(node))


def lasting_change_in(fdef: ast.FunctionDef) -> ast.AST | None:
    """Where method ``fdef`` changes an object that outlives it (:func:`_lasting_change`, its first argument's
    included: ``self.x = ...``), or None."""
    me = fdef.args.args[0].arg if fdef.args.args else None
    own, statements = _own_objects(fdef, me), {id(n.value) for n in ast.walk(fdef) if isinstance(n, ast.Expr)}
    return next((n for n in _scope_walk(fdef) if _lasting_change(n, me, own, statements) is not None), None) or \
        next((n for n in ast.walk(fdef) if _mutates(n, me)), None)


def _node_names(node: ast.AST, ctx: type) -> set[str]:
    """The names ``node`` loads (or stores, deletes) in its own scope, see :func:`_scope_walk`."""
    return {n.id for n in _scope_walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _target_root(target: ast.expr) -> ast.expr:
    """The object an assignment target mutates: ``x`` for ``x``, ``x.a``, ``x[i]``, ``x.a[i].b``."""
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        target = target.value
    return target


def _mutates(node: ast.AST, name: str) -> bool:
    """``node`` assigns to (or deletes) an attribute or item of the object named ``name``."""
    if not (isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del))):
        return False
    root = _target_root(node)
    return isinstance(root, ast.Name) and root.id == name


def _code_names(code: Any) -> set[str]:
    """The global and attribute names a code object (and the functions defined in it) reads."""
    return set(code.co_names).union(*(_code_names(c) for c in code.co_consts if inspect.iscode(c)))


def _method_called(node: ast.AST, name: str) -> str | None:
    """The method ``node`` calls on the object named ``name`` (``name.method(...)``), or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == name:
        return node.func.attr
    return None


def _stored_roots(target: ast.expr) -> set[str]:
    root = _target_root(target)
    return {root.id} if isinstance(root, ast.Name) else set()


def _find_escape(nodes: list[ast.AST]) -> ast.AST | None:
    """A break/continue that leaves the loop whose body is ``nodes`` (not one of an inner loop's)."""
    for n in nodes:
        if isinstance(n, (ast.Break, ast.Continue)):
            return n
        if isinstance(n, (ast.For, ast.While, ast.AsyncFor, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        found = _find_escape(list(ast.iter_child_nodes(n)))
        if found is not None:
            return found
    return None


_FILLS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard", "clear"}


def _lasting_change(node: ast.AST, me: str | None, own: set[str], statements: set[int]) -> ast.AST | None:
    """What of ``node`` changes an object that outlives the function whose self is ``me`` and whose locals are
    ``own`` (locals bound to objects made elsewhere left out): an attribute or item assigned or deleted, or a
    container filled or emptied (a call of ``statements``, whose value is unused: not optax's ``tx.update``), of
    ``me``, of a class or global, of what a call returns (``type(self).x``), or of such a local (``stats =
    self.stats``); ``setattr``/``delattr``. None if it changes only its own objects."""
    if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
        root = _target_root(node)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _FILLS and \
            id(node) in statements:
        root = _target_root(node.func.value)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
        return node
    else:
        return None
    return None if isinstance(root, ast.Name) and root.id != me and root.id in own else node


def _own_objects(fdef: ast.AST, me: str | None) -> set[str]:
    """The locals of ``fdef`` that only ever hold objects it makes: not ``me``, and not bound to an object
    reached from ``me`` or a global by attributes alone (``stats = self.stats``: changing it changes that)."""
    own = _node_names(fdef, ast.Store) - {me}
    pairs = [pair for n in _scope_walk(fdef) if isinstance(n, ast.Assign) for t in n.targets
             for pair in (zip(t.elts, n.value.elts) if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple)
                          and len(t.elts) == len(n.value.elts) else [(t, n.value)])]  # (a, b = x, self.y)
    shared = {t.id for t, v in pairs if isinstance(t, ast.Name) and _is_reference(v) and
              (_target_root(v).id == me or _target_root(v).id not in own)}
    return own - shared


def _outer_container_change(body: list[ast.stmt]) -> ast.Call | None:
    """A statement of ``body`` that fills or empties a container (``xs.append(v)``, ``d.update(...)``, its value
    unused) made outside ``body``: one not bound anywhere in it, so not fresh at each pass."""
    block = list(_scope_walk(ast.Module(body, [])))  # (a function defined in it keeps its own names)
    fresh = {n.id for n in block if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for n in (n.value for n in block if isinstance(n, ast.Expr)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _FILLS and \
                isinstance(n.func.value, ast.Name) and n.func.value.id not in fresh | {"self"}:
            return n
    return None


def _as_list(node: Any) -> list:
    return node if isinstance(node, list) else [] if node is None else [node]


def _is_reference(value: ast.expr) -> bool:
    """``self.a.b`` or ``name.a``: an object reached by attributes, no computation."""
    while isinstance(value, ast.Attribute):
        value = value.value
    return isinstance(value, ast.Name)


def _is_names(target: ast.expr) -> bool:
    if isinstance(target, ast.Name):
        return True
    if isinstance(target, ast.Starred):
        return _is_names(target.value)
    return isinstance(target, (ast.Tuple, ast.List)) and all(_is_names(e) for e in target.elts)


def _only_bound_flows_through(stmts: list[Stmt], bound: set[str]) -> set[str]:
    """A compound statement (``for``, ``if``, ...) reads what it assigns, as a path through it may skip the
    assignment and keep the value from before; but a name bound nowhere before it (its loop variable, a
    temporary of its body, a walrus's name) has no value from before. (Nor one bound only by the iteration before: the
    statement takes the same path in every iteration, its trip counts and conditions being the trace's.)
    Returns what is bound after ``stmts``."""
    for s in stmts:
        if s.kind == "loop":
            bound = _only_bound_flows_through(s.body, bound | {s.var})
            continue
        if s.kind == "compute" and isinstance(s.node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            s.uses -= s.defs - bound
        elif s.kind in ("compute", "return"):  # (a walrus's name read after it in the statement: bound there)
            s.uses -= {n.target.id for n in ast.walk(s.node) if isinstance(n, ast.NamedExpr)} - bound
        bound = bound | s.defs
    return bound


class Source:
    """A function's parsed source with the data needed to resolve names in it."""

    def __init__(self, fn: Callable, what: str):
        wrapper, fn = fn, inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        try:
            file = inspect.getsourcefile(fn) or "<unknown>"
            text = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            where = f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)
            raise CompileError(
                f"cannot read the source of {what} ({where}); msrl compiles the loop from its source",
                file=code.co_filename if code else None,
                line=code.co_firstlineno if code else None,
                hint="define the algorithm where Python keeps its source: a .py file or a Jupyter cell (not exec, "
                     "a lambda or the plain interactive prompt)",
            ) from None
        tree = ast.parse(text)
        fdef = tree.body[0]
        if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise CompileError(f"{what} is not a function definition", file=file, line=code.co_firstlineno)
        self.fn, self.file, self.fdef = fn, file, fdef
        self.offset = code.co_firstlineno - 1  # the source starts at the first decorator, if any
        if wrapper is not fn:  # (its source is the def's alone: the wrapper's work was dropped without a word)
            deco = fdef.decorator_list
            raise self.error(deco[0] if deco else fdef, f"{what} is wrapped by a decorator"
                             f"{f' (@{ast.unparse(deco[0])})' if deco else ''}; msrl compiles a method that uses the "
                             "API from its source, where the wrapper would not run",
                             "do what the decorator does inside the method, or call a plain function from it")
        self.lines = text.splitlines()
        self.namespace: dict[str, Any] = dict(fn.__globals__)
        if fn.__closure__:
            for name, cell in zip(code.co_freevars, fn.__closure__):
                try:
                    self.namespace[name] = cell.cell_contents
                except ValueError:  # empty cell
                    pass
        self.scope = {**builtins.__dict__, **self.namespace}  # what a global name means in this function
        self.what = what

    def line(self, node: ast.AST) -> int:
        return getattr(node, "lineno", self.fdef.lineno) + self.offset

    def text(self, node: ast.AST) -> str:
        first = getattr(node, "lineno", self.fdef.lineno)
        return self.lines[first - 1].strip() if 0 < first <= len(self.lines) else ast.unparse(node)

    def error(self, node: ast.AST, message: str, hint: str | None = None) -> CompileError:
        return CompileError(message, file=self.file, line=self.line(node), hint=hint)


class Frontend:
    def __init__(self, algorithm: Any, method: str = "train_step"):
        self.alg = algorithm
        self.method = method
        self.counter = itertools.count(1)
        self._own: dict[ast.AST, set[str]] = {}  # a function's locals that hold only its own objects
        self.tmp = itertools.count(1)
        self.namespace: dict[str, Any] = {}
        self.inlining: list[str] = []
        self._temps: set[str] = set()  # names the compiler introduces (hoisted results, inlined locals)
        self._uses_api_cache: dict[Any, bool] = {}
        self._judged: dict[str, set] = {}  # per file, the calls check_traced_calls has judged

    # ------------------------------------------------------------------------------------------ entry
    def build(self) -> list[Stmt]:
        from msrl.algorithm import Algorithm

        cls = type(self.alg)
        fn = getattr(cls, self.method, None)
        if fn is None or fn is getattr(Algorithm, self.method, None):
            methods = [n for n in dir(cls) if not n.startswith("__") and n != self.method
                       and callable(getattr(cls, n, None))]
            near = did_you_mean(self.method, methods)
            raise CompileError(f"{cls.__name__} defines no {self.method}(self), the training loop msrl compiles"
                               + (f" ({near.strip()})" if near else ""), *defined_at(cls))
        src = Source(fn, f"{cls.__name__}.{self.method}")
        args = src.fdef.args
        if [a.arg for a in args.args] != ["self"] or args.vararg or args.kwarg or args.kwonlyargs:
            raise src.error(src.fdef, f"{self.method}() must take only `self`", "the compiler threads all state")
        self.namespace.update(src.namespace)
        self._all_locals = _node_names(src.fdef, ast.Store)
        self.statics = self._static_locals(src)
        self._check_api_names(src)
        body = src.fdef.body
        stmts = [s for i, st in enumerate(body) for s in self._stmt(src, st, i == len(body) - 1, {}, None)]
        if not any(s.kind == "api" and s.api.name == "env_step" for s in leaves(stmts)):
            raise src.error(src.fdef, f"{type(self.alg).__name__}.{self.method}() never calls msrl.env_step()",
                            "an iteration must step the environments")
        # values known at compile time are the generated code's globals, not data: never a jitted function's
        # argument (a traced value where a shape needs an int) nor sent between fragments
        self.namespace.update(self.statics)
        for s in walk(stmts):
            s.defs, s.uses = s.defs - set(self.statics), s.uses - set(self.statics)
        _only_bound_flows_through(stmts, set())
        return stmts

    # ------------------------------------------------------------------------------------------ helpers
    def _check_api_names(self, src: Source) -> None:
        """A name the loop reads from one of msrl's modules that it lacks (``msrl.env_stepp``) is an error at its
        line, not a loop that "never calls msrl.env_step()" or a failure while tracing."""
        for node in ast.walk(src.fdef):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                module = self._resolve(src, node.value, self._all_locals)
                if inspect.ismodule(module) and module.__name__.split(".")[0] == "msrl" and not hasattr(module,
                                                                                                    node.attr):
                    names = {*dir(module), *getattr(module, "__all__", ())}  # (and the names it loads lazily)
                    near = did_you_mean(node.attr, sorted(n for n in names if not n.startswith("_")))
                    raise src.error(node, f"module {module.__name__!r} has no attribute {node.attr!r}"
                                    + (f" ({near.strip()})" if near else ""))

    def _new_id(self) -> str:
        return f"s{next(self.counter)}"

    def _scope(self, src: Source) -> dict[str, Any]:
        return {**src.scope, "self": self.alg}

    def _resolve(self, src: Source, expr: ast.expr, local: set[str]) -> Any:
        """The object a Name/Attribute chain rooted at a global (or ``self``) names, else None."""
        if isinstance(expr, ast.Name):
            if expr.id in local:
                return None
            if expr.id == "self":
                return self.alg
            return src.scope.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self._resolve(src, expr.value, local)
            return None if base is None else getattr(base, expr.attr, None)
        return None

    def _api_of(self, src: Source, call: ast.AST, local: set[str]) -> ApiSpec | None:
        return api_spec(self._resolve(src, call.func, local)) if isinstance(call, ast.Call) else None

    def _helper_of(self, src: Source, call: ast.AST) -> Callable | None:
        """A method of the algorithm called as ``self.name(...)`` whose body uses the API (to inline); a plain
        function that uses the API is refused (only the algorithm's methods are inlined)."""
        name = _method_called(call, "self")
        if name is None:
            inherited = self._super_method(src, call)
            if inherited is None:
                self._refuse_function_using_api(src, call)
            return inherited
        raw = inspect.getattr_static(type(self.alg), name, None)
        if isinstance(raw, (staticmethod, classmethod)):
            fn = raw.__func__
            if self._uses_api(fn):
                raise src.error(call, f"self.{name}() is a {type(raw).__name__} that uses the API",
                                "make it a plain method (helpers that use the API are inlined)")
            return None
        fn = getattr(type(self.alg), name, None)
        if not inspect.isfunction(fn):
            inner = inspect.unwrap(fn) if callable(fn) and hasattr(fn, "__wrapped__") else None
            if inspect.isfunction(inner) and self._uses_api(inner):  # (@jax.jit: "never calls msrl.env_step()")
                raise src.error(call, f"self.{name}() uses the API but is wrapped ({type(fn).__name__}: a decorator "
                                "such as @jax.jit); msrl compiles a method that uses the API from its source, "
                                "where the wrapper would not run", "drop the decorator: msrl jits the loop itself")
            return None
        if getattr(fn, "__qualname__", None) in self.inlining:
            raise src.error(call, f"helper self.{name}() calls itself; recursion cannot be compiled")
        return fn if self._uses_api(fn) else None

    def _super_method(self, src: Source, call: ast.AST) -> Callable | None:
        """The method ``super().name(...)`` calls from the method ``src`` is: the next one in the algorithm's MRO,
        inlined as any helper (a built-in's loop extended by a subclass: ``return super().train_step()``)."""
        f = call.func if isinstance(call, ast.Call) else None
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
                and f.value.func.id == "super" and not f.value.args and not f.value.keywords):
            return None
        mro = type(self.alg).__mro__
        owner = next((i for i, c in enumerate(mro) if any(inspect.isfunction(v) and inspect.unwrap(v) is src.fn
                                                           for v in vars(c).values())), None)
        base = next((c for c in mro[owner + 1:] if f.attr in vars(c)), None) if owner is not None else None
        fn = vars(base)[f.attr] if base is not None else None
        if not inspect.isfunction(fn):
            raise src.error(call, f"super().{f.attr}() names no plain method of a base class of the algorithm",
                            f"call a method of {type(self.alg).__name__} as self.name(...)")
        if getattr(fn, "__qualname__", None) in self.inlining:
            raise src.error(call, f"super().{f.attr}() calls itself; recursion cannot be compiled")
        return fn

    def _refuse_function_using_api(self, src: Source, call: ast.AST) -> None:
        """A call of a plain function (another module's, say) that calls the API itself: the compiler would not
        see those calls (the loop would seem not to step its environments, or the API would run outside it)."""
        if not isinstance(call, ast.Call) or not isinstance(call.func, (ast.Name, ast.Attribute)):
            return
        local = _node_names(src.fdef, ast.Store) | {a.arg for a in src.fdef.args.args[1:]}  # (self: the algorithm)
        fn = self._resolve(src, call.func, local)
        fn = fn.__func__ if inspect.ismethod(fn) else fn  # (another object's: self.helper.collect(...))
        if not inspect.isfunction(fn) or not set(API) & _code_names(fn.__code__) or not self._uses_api(fn):
            return  # (the names its code reads first: no source of jax's functions is parsed)
        where = f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}"
        raise src.error(call, f"{fn.__qualname__}() ({where}) calls the msrl API, but the compiler inlines only "
                              f"methods of the algorithm: it cannot see the API calls of a function",
                        f"make {fn.__name__} a method of {type(self.alg).__name__} and call it as "
                        f"self.{fn.__name__}(...), or make its API calls in {self.method}() itself")

    def _uses_api(self, fn: Callable) -> bool:
        if fn not in self._uses_api_cache:
            self._uses_api_cache[fn] = False  # a recursive helper sees False while it is being read
            try:
                helper = Source(inspect.unwrap(fn), fn.__qualname__)  # (a wrapped one is refused where inlined)
            except CompileError:
                return False
            self._uses_api_cache[fn] = any(
                (isinstance(n, (ast.Name, ast.Attribute)) and api_spec(self._resolve(helper, n, set())))
                or (isinstance(n, ast.Call) and self._helper_of(helper, n) is not None)
                for n in ast.walk(helper.fdef)
            )
        return self._uses_api_cache[fn]

    def _static_locals(self, src: Source, params: tuple[str, ...] = (), known: dict[str, Any] | None = None
                       ) -> dict[str, Any]:
        """Locals assigned once, at the top level, from expressions of ``self``/globals/constants: their
        values are known at compile time (so ``n = self.cfg.steps; for _ in range(n)`` is static). So is a
        lambda of such values assigned once anywhere (``f = lambda x: jnp.tanh(x) * scale``): a function, never
        data (it cannot be a jitted piece's argument or result). An ``if`` on ``self``, globals and constants
        alone counts as its taken branch (``if self.cfg.n_step: B = self.cfg.batch_size`` is top level).
        ``params``: an inlined helper's parameters, ``known``: those bound to compile-time values, and these."""
        known = known or {}
        live = ast.Module(self._taken(src, copy.deepcopy(src.fdef.body), known), [])
        counts: dict[str, int] = dict.fromkeys(params, 1)  # (a parameter has its value from the call)
        for node in _scope_walk(live):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                counts[node.id] = counts.get(node.id, 0) + 1
        statics: dict[str, Any] = dict(known)
        lambdas = [n for n in _scope_walk(live) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda)
                   and n not in live.body]
        todo, top = [*live.body, *lambdas], {id(st) for st in live.body}
        while todo:
            st = todo.pop(0)
            if isinstance(st, ast.If) and id(st) in top:  # an if on the statics found so far: its taken branch
                taken = self._taken(src, [st], statics)
                if taken != [st]:
                    todo[:0] = taken
                    top.update(map(id, taken))
                    continue
            if isinstance(st, ast.FunctionDef) and not st.decorator_list and counts.get(st.name) == 1:
                # a def of the loop's own that reads only statics and globals: a function, as a lambda is (it was
                # a local a jitted piece could not return, a NameError where the loop is cut after it)
                free = {n.id for n in _scope_walk(ast.Module([st], [])) if isinstance(n, ast.Name)
                        and isinstance(n.ctx, ast.Load)}
                plain = not any(isinstance(n, ast.Call) for d in st.args.defaults + st.args.kw_defaults
                                if d is not None for n in ast.walk(d))
                if plain and not free & (set(counts) - set(statics)):
                    space, node = {**self._scope(src), **statics}, ast.increment_lineno(copy.deepcopy(st), src.offset)
                    try:  # (its lines as in the user's file)
                        exec(compile(ast.Module([node], []), src.file, "exec"), space)
                    except Exception:  # noqa: BLE001 - not static then: it stays as written
                        continue
                    statics[st.name] = space[st.name]
                continue
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and _is_names(st.targets[0])):
                continue
            target = st.targets[0]
            names = [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
            if any(isinstance(n, ast.Starred) for n in ast.walk(target)) or any(counts.get(n) != 1 for n in names) \
                    or _node_names(st.value, ast.Load) & (set(counts) - set(statics)):
                continue
            function = isinstance(st.value, ast.Lambda)  # (its body's calls run when it is called, not here)
            if any(isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _PURE_BUILTINS)
                   for n in ast.walk(ast.Tuple(st.value.args.defaults, ast.Load()) if function else st.value)):
                continue  # only plain expressions: never run user calls (or the API) at compile time
            try:  # (a lambda sees the statics as its globals)
                value = eval(compile(ast.Expression(st.value), "<static>", "eval"), {**self._scope(src), **statics})
            except Exception:
                continue
            if isinstance(target, ast.Name):
                values = {target.id: value}
            elif isinstance(value, (tuple, list)) and len(value) == len(target.elts) and all(
                    isinstance(e, ast.Name) for e in target.elts):  # `n, m = self.cfg.a, self.cfg.b`
                values = {e.id: v for e, v in zip(target.elts, value)}
            else:
                continue
            # a value of the config's (or a plain `cfg = self.cfg`): the same wherever the loop runs
            if all(isinstance(v, _STATIC_TYPES) for v in values.values()) or _is_reference(st.value) or function:
                statics.update(values)
        return statics

    def _taken(self, src: Source, body: list[ast.stmt], statics: dict[str, Any] | None = None) -> list[ast.stmt]:
        """``body`` with each ``if`` whose condition reads only ``self``, globals, constants and ``statics`` (no
        call but :data:`_PURE_BUILTINS`) replaced by its taken branch (a local it assigns is then assigned once)."""
        statics = statics or {}

        def decided(test: ast.expr) -> bool | None:
            if _node_names(test, ast.Load) & self._all_locals - set(statics) or any(
                    isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _PURE_BUILTINS)
                    for n in ast.walk(test)):
                return None
            try:
                return bool(eval(compile(ast.Expression(test), "<static>", "eval"), {**self._scope(src),
                                                                                       **statics}))
            except Exception:  # noqa: BLE001 - not decidable here: it stays as written
                return None

        class Prune(ast.NodeTransformer):
            def visit_If(self, st: ast.If) -> Any:
                test = decided(st.test)
                if test is None:
                    return self.generic_visit(st)
                return [out for b in (st.body if test else st.orelse) for out in _as_list(self.visit(b))]

            def visit_FunctionDef(self, st: ast.AST) -> Any:  # (its own names: not the loop's)
                return st

            visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

        return [out for st in body for out in _as_list(Prune().visit(st))]

    def _static_eval(self, src: Source, expr: ast.expr, rename: dict[str, str], what: str, hint: str) -> Any:
        local_names = _node_names(expr, ast.Load) - {"self"}
        unknown = {n for n in local_names if n in self._all_locals and rename.get(n, n) not in self.statics}
        if unknown:
            stores = [n.id for n in _scope_walk(src.fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
            twice = sorted(n for n in unknown if stores.count(n) > 1)  # (`T = T // 2`: known, but not to msrl)
            why = f"assigned more than once ({', '.join(twice)}: a value known at compile time is a local assigned " \
                "once, at the top level, from self, globals and constants)" if twice else "only known at run time"
            raise src.error(expr, f"{what} depends on {', '.join(sorted(unknown))}, which is {why}", hint)
        scope = self._scope(src)
        scope.update({k: self.statics[rename.get(k, k)] for k in local_names if rename.get(k, k) in self.statics})
        try:
            return eval(compile(ast.Expression(expr), "<static>", "eval"), scope)
        except Exception as e:
            raise src.error(expr, f"{what} could not be evaluated at compile time ({type(e).__name__}: {e})",
                            hint) from None

    # ------------------------------------------------------------------------------------------ statements
    def _touches_api(self, src: Source, node: ast.AST) -> bool:
        for n in ast.walk(node):
            if isinstance(n, (ast.Name, ast.Attribute)) and api_spec(self._resolve(src, n, self._all_locals)):
                return True
            if isinstance(n, ast.Call) and self._helper_of(src, n) is not None:
                return True
        return False

    def _static_test(self, src: Source, st: ast.If, rename: dict[str, str]) -> bool | None:
        """The value of an ``if``'s condition if it is decidable at compile time (on self.cfg, constants), else None."""
        try:
            return bool(self._static_eval(src, st.test, rename, "", ""))
        except CompileError:
            return None

    def _live(self, src: Source, node: ast.AST, rename: dict[str, str]) -> Any:
        """A copy of ``node`` whose compile-time ``if``s are replaced by their taken branch: what compiles, and what
        the checks see (an untaken branch is neither compiled nor refused)."""
        frontend = self

        class Prune(ast.NodeTransformer):
            def visit_If(self, st: ast.If) -> Any:
                test = frontend._static_test(src, st, rename)
                if test is None:
                    return self.generic_visit(st)
                return [out for b in (st.body if test else st.orelse) for out in _as_list(self.visit(b))]

            def visit_FunctionDef(self, st: ast.AST) -> Any:  # (its own names: not the loop's statics)
                return st

            visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

        return Prune().visit(copy.deepcopy(node))

    def _stmt(self, src: Source, st: ast.stmt, is_last: bool, rename: dict[str, str], loop: str | None):
        if isinstance(st, (ast.Global, ast.Nonlocal)):
            raise src.error(st, f"`{type(st).__name__.lower()}` cannot be compiled", "keep state in components")
        test = self._static_test(src, st, rename) if isinstance(st, ast.If) else None
        if test is not None:  # decidable at compile time (on self.cfg): only its branch runs, and is checked
            return [s for b in (st.body if test else st.orelse) for s in self._stmt(src, b, False, rename, loop)]
        st = self._live(src, st, rename)  # (its compile-time ifs' untaken branches: not checked either)
        check_traced_calls(st, self._scope(src), src.file, src.line, src.what, "msrl traces the loop", "iteration",
                           "draw random numbers with jax.random from a key in a component's state (the actor's, as "
                           "its act() gets it; a value differs too by how often a policy traces the loop); time what "
                           "runs outside the loop", self._judged.setdefault(src.file, set()))
        api = self._touches_api(src, st)
        for n in ast.walk(st):
            if isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await)):
                raise src.error(n, "generators and coroutines cannot be compiled", "write a plain loop")
        self._check_no_self_mutation(src, st)
        self._check_no_helper_value(src, st)
        self._check_no_reserved(src, st)
        deleted = next((n for n in _scope_walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Del)), None)
        if deleted is not None:
            raise src.error(deleted, f"`del {deleted.id}` cannot be compiled: the compiler follows every variable's "
                            "value through the loop", "drop the `del` (values nobody uses later are not kept)")
        if isinstance(st, ast.Return):
            if not is_last:
                raise src.error(st, "`return` must be the last statement of the training loop",
                                "compute the value and return it once at the end")
            return self._return(src, st, rename, loop)
        nested_return = next((n for n in _scope_walk(st) if isinstance(n, ast.Return)), None)  # (not a def's own)
        if nested_return is not None and not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise src.error(nested_return, "`return` must be the last statement of the training loop, not inside "
                            f"`{type(st).__name__.lower()}`", "assign the value and return it once at the end")
        if not api:  # (an `if` on values of the loop: one compute statement, traced as it is)
            return [self._compute(src, st, rename, loop)]
        if isinstance(st, ast.For):
            return [self._loop(src, st, rename, loop)]
        if isinstance(st, ast.If):
            test = self._static_eval(
                src, st.test, rename, "the condition of an `if` around API calls",
                "an `if` around API calls must be decidable at compile time (e.g. on self.cfg); "
                "for data-dependent choices compute both values and select with jnp.where; to treat one "
                "iteration of a loop apart (`if t == 0`), write it out before the loop and loop over the rest",
            )
            out = []
            for s in st.body if test else st.orelse:
                out.extend(self._stmt(src, s, False, rename, loop))
            return out
        if isinstance(st, ast.While):
            raise src.error(st, "a `while` loop around API calls cannot be compiled (its trip count is not static)",
                            "use `for _ in range(N)` with N known at compile time (e.g. from self.cfg)")
        if isinstance(st, (ast.Try, ast.With, ast.AsyncWith, ast.AsyncFor, ast.Match)):
            raise src.error(st, f"API calls inside `{type(st).__name__.lower()}` cannot be compiled",
                            "move the API call out of the block")
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise src.error(st, "a nested function or class that uses the API cannot be compiled",
                            "make it a method of the algorithm (helper methods are inlined)")
        if isinstance(st, ast.Delete):
            raise src.error(st, "`del` of API results cannot be compiled")
        if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)):
            return self._hoist(src, st, rename, loop)
        raise src.error(st, f"`{type(st).__name__}` statements using the API cannot be compiled")

    def _check_no_self_mutation(self, src: Source, st: ast.stmt) -> None:
        own = self._own.get(src.fdef)
        if own is None:
            own = self._own[src.fdef] = _own_objects(src.fdef, "self")
        scope = {id(n) for n in _scope_walk(ast.Module([st], []))}  # (a def's own locals are its own)
        statements = {id(n.value) for n in ast.walk(st) if isinstance(n, ast.Expr)}
        for n in ast.walk(st):
            if _mutates(n, "self"):
                raise src.error(n, "the training loop must not assign to (or delete) attributes of `self`",
                                "state that changes belongs in a component (actor, learner, buffer)")
            if id(n) in scope and _lasting_change(n, "self", own, statements) is not None:
                raise src.error(n, "the training loop must not change an object that outlives it (of `self`, a "
                                "class, a global, or a local bound to one): the loop is traced several times (and "
                                "by each replica), so the change would depend on how often, and each policy would "
                                "compute something else", "state that changes belongs in a component (actor, "
                                "learner, buffer); a value the loop uses is computed in it, from components' state")
            method = _method_called(n, "self")
            if method is not None and self._helper_of(src, n) is None:  # a method called as it is
                at = self._mutation_in(getattr(type(self.alg), method, None))
                if at is not None:
                    raise src.error(n, f"self.{method}() changes an object that outlives the loop, of `self` or "
                                    f"a class or global ({at}): the training loop is traced several times (and by "
                                    "each replica), so such a change would depend on how often",
                                    "state that changes belongs in a component (actor, learner, buffer)")

    def _check_no_helper_value(self, src: Source, st: ast.stmt) -> None:
        """A method that uses the API taken as a value (``roll = self.rollout``): the API calls in it are compiled
        only where the loop calls it as ``self.rollout(...)``."""
        called = {id(n.func) for n in ast.walk(st) if isinstance(n, ast.Call)}
        for n in ast.walk(st):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and \
                    isinstance(n.ctx, ast.Load) and id(n) not in called:
                fn = inspect.getattr_static(type(self.alg), n.attr, None)
                fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
                if inspect.isfunction(fn) and self._uses_api(fn):
                    raise src.error(n, f"self.{n.attr}, a method that uses the API, is used as a value; the loop "
                                    "compiles its API calls where it calls it", f"call it: self.{n.attr}(...)")

    def _mutation_in(self, fn: Callable, seen: frozenset = frozenset()) -> str | None:
        """Where method ``fn`` (or a method it calls on its ``self``) assigns to or deletes an attribute of its
        ``self``, as file:line, or None (also for anything but a plain function)."""
        if not inspect.isfunction(fn) or fn in seen:
            return None
        try:
            helper = Source(fn, fn.__qualname__)
        except CompileError:
            return None
        changed = lasting_change_in(helper.fdef)
        if changed is not None:
            return f"{helper.file}:{helper.line(changed)}"
        me = helper.fdef.args.args[0].arg if helper.fdef.args.args else None
        for n in ast.walk(helper.fdef):
            method = _method_called(n, me)
            at = method and self._mutation_in(getattr(type(self.alg), method, None), seen | {fn})
            if at:
                return at
        return None

    def _check_no_reserved(self, src: Source, st: ast.stmt) -> None:
        """The user's own code names none of msrl's generated variables: assigning one would clobber it (or
        be clobbered), reading one would read the compiler's state. A global of that name is the user's."""
        for n in ast.walk(st):
            if (isinstance(n, ast.Name) and n.id.startswith(RESERVED_PREFIXES)
                    and (not isinstance(n.ctx, ast.Load) or n.id not in src.scope)):
                raise src.error(n, f"the name `{n.id}` is reserved for msrl's generated code", "rename the variable")

    def _rename(self, node: ast.AST, rename: dict[str, str]) -> ast.AST:
        """A copy of ``node`` with local names renamed (for inlined helpers), keeping its line number."""
        new = copy.deepcopy(node)
        for n in ast.walk(new):
            if isinstance(n, ast.Name):
                n.id = rename.get(n.id, n.id)
        return new

    def _reserved(self, src: Source, st: ast.AST, names: set[str]) -> None:
        for n in names:
            if n.startswith(RESERVED_PREFIXES) and n not in self._temps:
                raise src.error(st, f"the name `{n}` is reserved for msrl's generated code", "rename the variable")

    def _compute(self, src: Source, st: ast.stmt, rename: dict[str, str], loop: str | None) -> Stmt:
        node = self._rename(st, rename)
        defs, uses = set(), _node_names(node, ast.Load)
        for n in _scope_walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                defs.add(n.id)
            if isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store):
                roots = _stored_roots(n)
                defs |= roots
                uses |= roots
        if isinstance(node, ast.AugAssign):
            uses |= _stored_roots(node.target)
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            uses |= defs  # assigned only on some paths: the value from before may flow through
        self._reserved(src, st, defs)
        locals_ = self._locals(rename)
        return Stmt(self._new_id(), "compute", src.file, src.line(st), src.text(st),
                    frozenset(defs & locals_), frozenset(uses & locals_), node=node, parent=loop)

    def _locals(self, rename: dict[str, str]) -> set[str]:
        return set(self._all_locals) | set(rename.values()) | self._temps

    def _return(self, src: Source, st: ast.Return, rename: dict[str, str], loop: str | None) -> list[Stmt]:
        value = st.value or ast.Constant(None)
        out, node = self._hoist_expr(src, st, value, rename, loop)
        uses = _node_names(node, ast.Load) & self._locals(rename)
        out.append(Stmt(self._new_id(), "return", src.file, src.line(st), src.text(st),
                        defs=frozenset({"_result"}), uses=frozenset(uses), node=node, parent=loop))
        return out

    def _loop(self, src: Source, st: ast.For, rename: dict[str, str], parent: str | None) -> Stmt:
        hint = "loops around API calls must be `for NAME in range(N)` with N known at compile time"
        it = st.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                and src.scope.get("range") is range and not it.keywords and 1 <= len(it.args) <= 3):
            raise src.error(st, f"cannot compile a loop over `{ast.unparse(it)}` around API calls", hint)
        if not isinstance(st.target, ast.Name):
            raise src.error(st, "the loop variable must be a single name", hint)
        if st.orelse:
            raise src.error(st, "`for ... else` around API calls cannot be compiled", "drop the else block")
        bounds = [self._static_eval(src, a, rename, "the loop bound", hint) for a in it.args]
        if not all(isinstance(b, int) for b in bounds):
            raise src.error(st, f"range bounds must be ints, got {bounds}", hint)
        if not all(-(2**31) <= b < 2**31 for b in bounds):
            raise src.error(st, f"range bounds must fit in int32, got {bounds}",
                            "a loop around API calls runs as lax.scan with an int32 counter")
        if len(bounds) == 3 and bounds[2] == 0:
            raise src.error(st, f"`{ast.unparse(it)}` has a step of 0", hint)
        r = range(*bounds)
        if len(r) == 0:
            raise src.error(st, f"`{ast.unparse(it)}` is empty: the loop body would never run",
                            "a loop around API calls must run at least once")
        escape = _find_escape(st.body)
        if escape is not None:
            raise src.error(escape, f"`{type(escape).__name__.lower()}` in a loop with API calls cannot be compiled",
                            "loops around API calls run a static number of times; mask values instead")
        change = _outer_container_change(st.body)
        if change is not None:
            name = change.func.value.id
            raise src.error(change, f"`{ast.unparse(change.func)}(...)` in a loop around API calls changes `{name}`, "
                            "made before the loop: the loop runs as one traced step (lax.scan), so it would hold one "
                            "step's traced values, not one per iteration",
                            "collect per-step values with msrl.buffer_insert and read them with msrl.buffer_get, or "
                            "carry an array and write each step into it (`x = x.at[t].set(v)`)")
        var = rename.get(st.target.id, st.target.id)
        self._reserved(src, st, {var})
        lid = self._new_id()
        body: list[Stmt] = []
        for s in st.body:
            body.extend(self._stmt(src, s, False, rename, lid))
        return Stmt(lid, "loop", src.file, src.line(st), src.text(st), defs=frozenset({var}),
                    var=var, range=(r.start, r.stop, r.step), body=body, parent=parent)

    # ------------------------------------------------------------------------------------------ hoisting
    def _hoist(self, src: Source, st: ast.stmt, rename: dict[str, str], loop: str | None) -> list[Stmt]:
        value = st.value
        if value is None:  # bare annotation
            return [self._compute(src, st, rename, loop)]
        # direct form: `target = msrl.api(...)` or `msrl.api(...)` with plain arguments
        target, direct = None, isinstance(st, ast.Expr)
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            target, direct = st.targets[0], _is_names(st.targets[0])
        elif isinstance(st, ast.AnnAssign):
            target, direct = st.target, _is_names(st.target)
        spec = self._api_of(src, value, self._all_locals)
        if spec is not None and direct and not any(
            self._touches_api(src, a) for a in [*value.args, *(k.value for k in value.keywords)]
        ):
            return [self._api_stmt(src, st, spec, value, target, rename, loop)]
        out, new_value = self._hoist_expr(src, st, value, rename, loop)
        rest = self._rename(st, rename)
        rest.value = new_value
        stmt = self._compute(src, rest, {}, loop)
        out.append(stmt)
        return out

    def _hoist_expr(self, src: Source, st: ast.stmt, expr: ast.expr, rename: dict[str, str], loop: str | None):
        """Move API calls (and inlined helper calls) out of ``expr`` into temporaries, innermost first."""
        out: list[Stmt] = []
        frontend = self

        class H(ast.NodeTransformer):
            def visit_Lambda(self, n):
                return self._forbid(n, "a lambda")

            def visit_ListComp(self, n):
                return self._forbid(n, "a comprehension")

            visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp

            def visit_IfExp(self, n):
                return self._forbid(n, "a conditional expression", "call it unconditionally and select with jnp.where")

            def visit_BoolOp(self, n):
                return self._forbid(n, "`and`/`or`", "call it unconditionally before the expression")

            def _forbid(self, n, what, hint="call it in its own statement"):
                if frontend._touches_api(src, n):
                    raise src.error(n, f"an API call inside {what} cannot be compiled", hint)
                return n

            def visit_Call(self, n: ast.Call):
                spec = frontend._api_of(src, n, frontend._all_locals)
                helper = None if spec else frontend._helper_of(src, n)
                if spec is None and helper is None:
                    self.generic_visit(n)
                    return n
                n.args = [self.visit(a) for a in n.args]
                for k in n.keywords:
                    k.value = self.visit(k.value)
                tmp = f"_api{next(frontend.tmp)}"
                frontend._temps.add(tmp)
                name = ast.Name(tmp, ast.Store())
                if spec is not None:
                    out.append(frontend._api_stmt(src, st, spec, n, name, rename, loop, renamed=True))
                else:
                    out.extend(frontend._inline(src, n, helper, tmp, loop))
                return ast.copy_location(ast.Name(tmp, ast.Load()), n)

            def visit_NamedExpr(self, n: ast.NamedExpr):  # `(step := msrl.env_step(a)).reward + step.done`: the
                n.value, n.target = self.visit(n.value), self.visit(n.target)  # name is bound as the call is hoisted,
                if isinstance(n.value, ast.Name) and n.value.id in frontend._temps:  # so what follows reads it
                    bind = ast.copy_location(ast.Assign([ast.Name(n.target.id, ast.Store())], n.value), n)
                    out.append(frontend._compute(src, ast.fix_missing_locations(bind), {}, loop))
                    return ast.copy_location(ast.Name(n.target.id, ast.Load()), n)
                return n

            def visit_Name(self, n: ast.Name):
                if api_spec(frontend._resolve(src, n, frontend._all_locals)):
                    raise src.error(n, f"msrl.{n.id} is used as a value; API functions can only be called",
                                    "call it directly in the loop")
                return ast.copy_location(ast.Name(rename.get(n.id, n.id), n.ctx), n)

            def visit_Attribute(self, n: ast.Attribute):
                spec = api_spec(frontend._resolve(src, n, frontend._all_locals))
                if spec:
                    raise src.error(n, f"msrl.{spec.name} is used as a value; API functions can only be called",
                                    "call it directly in the loop")
                self.generic_visit(n)
                return n

        # the transformer renames as it goes, so hoisted statements see renamed arguments
        new = H().visit(copy.deepcopy(expr))
        return out, ast.fix_missing_locations(new)

    def _api_stmt(self, src: Source, st: ast.stmt, spec: ApiSpec, call: ast.Call, target: ast.expr | None,
                  rename: dict[str, str], loop: str | None, renamed: bool = False) -> Stmt:
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            raise src.error(call, f"msrl.{spec.name}() cannot take *args/**kwargs", "pass the arguments explicitly")
        try:
            spec.signature.bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except TypeError as e:
            raise src.error(call, f"msrl.{spec.name}{spec.signature}: {e}",
                            "API calls take no component state: the compiler threads it") from None
        if getattr(self.alg, spec.component, None) is None and spec.component != "env":
            raise src.error(call, f"msrl.{spec.name}() needs the algorithm to have a `{spec.component}` component",
                            f"set self.{spec.component} in {type(self.alg).__name__}.__init__")
        args = tuple(a if renamed else self._rename(a, rename) for a in call.args)
        kwargs = tuple((k.arg, k.value if renamed else self._rename(k.value, rename)) for k in call.keywords)
        if target is not None and not renamed:
            target = self._rename(target, rename)
        locals_ = self._locals(rename)
        uses = set()
        for a in args + tuple(v for _, v in kwargs):
            uses |= _node_names(a, ast.Load) & locals_
        defs = _node_names(target, ast.Store) if target is not None else set()
        self._reserved(src, st, defs)
        uses |= {state_var(c) for c in spec.reads}
        defs |= {state_var(c) for c in spec.writes}
        uses |= {state_var(c) for c in spec.writes if c != "params"}  # a write updates the previous state
        # (the learner's params are derived from its own state, never updated in place)
        return Stmt(self._new_id(), "api", src.file, src.line(call), src.text(st), frozenset(defs),
                    frozenset(uses), api=spec, target=target, args=args, kwargs=kwargs, parent=loop)

    def _inline(self, src: Source, call: ast.Call, fn: Callable, result: str, loop: str | None) -> list[Stmt]:
        helper = Source(fn, fn.__qualname__)
        for name in _node_names(helper.fdef, ast.Load):
            if name in helper.namespace and name in self.namespace and helper.namespace[name] is not self.namespace[name]:
                raise helper.error(helper.fdef, f"helper {fn.__qualname__} uses the global `{name}`, which means "
                                   f"something else where train_step is defined", "rename one of them")
        self.namespace.update({k: v for k, v in helper.namespace.items() if k not in self.namespace})
        prefix = f"_h{next(self.tmp)}_"
        params = [a.arg for a in helper.fdef.args.args][1:]
        if helper.fdef.args.vararg or helper.fdef.args.kwarg or helper.fdef.args.kwonlyargs:
            raise helper.error(helper.fdef, "helpers that use the API must take plain positional parameters")
        if any(isinstance(a, ast.Starred) for a in call.args) or call.keywords and any(k.arg is None for k in call.keywords):
            raise src.error(call, "cannot inline a helper called with *args/**kwargs")
        defaults = helper.fdef.args.defaults
        bound: dict[str, ast.expr] = dict(zip(params[len(params) - len(defaults):], defaults))
        bound.update(zip(params, call.args))
        for k in call.keywords:
            bound[k.arg] = k.value
        missing = [p for p in params if p not in bound]
        if len(call.args) > len(params) or missing or set(bound) - set(params):
            raise src.error(call, f"self.{fn.__name__}() called with the wrong arguments (takes {', '.join(params)})")
        assigned = _node_names(helper.fdef, ast.Store)
        helper_locals = assigned | set(params)
        rename = {n: prefix + n for n in helper_locals}
        known = {}
        for p in params:  # a parameter bound to a compile-time value is static inside the helper
            if p not in assigned:
                try:
                    value = self._static_eval(src, bound[p], {}, "", "")
                except CompileError:
                    continue
                if isinstance(value, _STATIC_TYPES):
                    known[p] = value
        self._temps |= set(rename.values())
        outer_locals = self._all_locals
        out = [self._compute(src, ast.copy_location(ast.Assign([ast.Name(rename[p], ast.Store())], bound[p]), call),
                             {}, loop) for p in params]
        self.inlining.append(fn.__qualname__)
        try:
            self._all_locals = helper_locals
            # its parameters bound to compile-time values and its own locals of them are static, as train_step's
            self.statics.update({rename[k]: v for k, v in self._static_locals(helper, params, known).items()})
            body = helper.fdef.body
            ret = body[-1] if body and isinstance(body[-1], ast.Return) else None
            for st in body[:-1] if ret else body:
                early = None if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else next(
                    (n for n in _scope_walk(st) if isinstance(n, ast.Return)), None)  # (not a nested def's own)
                if early is not None:
                    raise helper.error(early, "a helper that uses the API may only `return` as its last statement",
                                       "assign the value and return it once at the end")
                out.extend(self._stmt(helper, st, False, rename, loop))
            value = ret.value if ret is not None and ret.value is not None else ast.Constant(None)
            assign = ast.copy_location(ast.Assign([ast.Name(result, ast.Store())], value), ret or helper.fdef)
            out.extend(self._hoist(helper, assign, rename, loop))
        finally:
            self.inlining.pop()
            self._all_locals = outer_locals
        return out


def parse(algorithm: Any, method: str = "train_step") -> tuple[list[Stmt], dict[str, Any]]:
    """The IR of ``algorithm.<method>`` and the namespace its code runs in."""
    fe = Frontend(algorithm, method)
    stmts = fe.build()
    return stmts, fe.namespace


__all__ = ["parse", "API"]
