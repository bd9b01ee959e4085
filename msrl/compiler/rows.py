"""Does a statement compute each environment's row from that environment's rows alone?

A policy that splits the environments over replicas runs the actor side of the loop on each replica's share and
joins the results in global environment order. That equals the loop only where row ``i`` of every value depends on
environment ``i`` alone. :func:`mixing` tells, for one statement, whether it may break this: it traces the
statement at two environment counts (the loop's ``N`` and a replica's share ``n``; an axis whose size differs is an
environment axis) and walks the two jaxprs side by side. The share is what the replicas run: a number computed from
the count (``min(n, 8)``, an ``if`` on it) is judged at the very counts that meet. A value mixes rows when it comes
from a reduction, a cumulative op, a sort, a slice, a shift or an indexing along an environment axis, a matrix
product over it, random numbers or an ``iota`` laid along it (numbered by position in the replica, not by
environment), a second environment axis (every environment with every other), or a number that changes with the
count of environments. The walk is conservative: a primitive it does not know, touching an environment axis, counts
as mixing (the policy then refuses the loop; it never runs it differently)."""

from __future__ import annotations

import ast
import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.extend import core

from msrl.compiler.ir import Stmt, is_state
from msrl.components import ENV_METHODS, Environment, vouched_rowwise

_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
           "argmax", "argmin"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_KEYS = {"random_wrap", "random_unwrap", "random_fold_in", "random_seed", "random_key_data", "random_clone",
         "bitcast_convert_type", "threefry2x32"}  # per key (a trailing axis of key data may come or go)
_ELEMENTWISE = set("""abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp clz
    complex conj convert_element_type cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
    igamma igamma_grad_a igammac imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or polygamma population_count pow random_gamma random_gamma_grad real reduce_precision
    regularized_incomplete_beta rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign
    sin sinh sqrt square sub tan tanh xor zeta""".split())  # each output element from the same-place inputs
_IDENTITY = {"stop_gradient", "device_put", "optimization_barrier", "copy", "sharding_constraint", "pvary"}  # as given
_LINALG = {"cholesky", "triangular_solve", "lu", "qr", "eigh", "eig", "svd", "householder_product", "schur",
           "tridiagonal", "tridiagonal_solve"}  # on the last two axes, batched over the leading ones
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")  # where calls (jit, custom_jvp/vjp, checkpoint) keep their body

VOUCHED = "_msrl_vouched_rowwise"  # a call of a method of an env msrl vouches for (see trusting)
COUNT = "uses a number that depends on how many environments a replica holds"
SHAPE = "computes differently for different numbers of environments"


def _dims(sa: tuple, sb: tuple) -> frozenset[int] | None:
    """The axes of a value's shape traced at N environments (``sa``) and at a replica's share (``sb``) whose
    sizes differ."""
    if len(sa) != len(sb):
        return None
    return frozenset(i for i, (m, n) in enumerate(zip(sa, sb)) if m != n)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=np.asarray(a).dtype.kind in "fc"))
    except Exception:  # noqa: BLE001 - an opaque constant (a key): compare what can be compared
        return a is b


def _consts(c1: list, c2: list) -> list[str | None]:
    """Constants a jaxpr closes over: the same at both environment counts, or why not."""
    return [None if np.shape(x) == np.shape(y) and _same(x, y) else
            COUNT if _dims(np.shape(x), np.shape(y)) == frozenset() else
            "uses an array made outside it with one row per environment" for x, y in zip(c1, c2)]


def _walk(j1: core.Jaxpr, j2: core.Jaxpr, consts: list[str | None], ins: list[str | None]) -> list[str | None]:
    """The reason each output of ``j1`` (its twin ``j2`` traced at a replica's share of the environments) mixes
    rows, or None."""
    if len(j1.eqns) != len(j2.eqns) or len(j1.invars) != len(j2.invars):
        return [SHAPE] * len(j1.outvars)
    why: dict[Any, str | None] = dict(zip(j1.constvars, consts)) | dict(zip(j1.invars, ins))

    def read(v: Any) -> str | None:
        return None if isinstance(v, core.Literal) else why.get(v)

    for e1, e2 in zip(j1.eqns, j2.eqns):
        reasons = _eqn(e1, e2, [read(v) for v in e1.invars])
        why.update(zip(e1.outvars, reasons))
    return [read(v) for v in j1.outvars]  # a Python number defined here is judged where it is used


def _closed(jaxpr: Any) -> tuple[core.Jaxpr, list]:
    return (jaxpr.jaxpr, list(jaxpr.consts)) if isinstance(jaxpr, core.ClosedJaxpr) else (jaxpr, [])


def _call(j1: Any, j2: Any, ins: list[str | None]) -> list[str | None]:
    (b1, c1), (b2, c2) = _closed(j1), _closed(j2)
    return _walk(b1, b2, _consts(c1, c2), ins)


def _eqn(e1: core.JaxprEqn, e2: core.JaxprEqn, ins: list[str | None]) -> list[str | None]:
    n = len(e1.outvars)
    if not n:  # (a callback that returns nothing, jax.debug.print's: nothing it sees reaches a value)
        return []
    mixed = next((r for r in ins if r and r != COUNT), None) or next((r for r in ins if r), None)  # (a reduction
    if mixed:  # beside the count it divides by is what mixes: x / x.std())
        return [mixed] * n
    name = e1.primitive.name
    if name != e2.primitive.name or len(e1.invars) != len(e2.invars):
        return [SHAPE] * n
    for a, b in zip(e1.invars, e2.invars):
        if isinstance(a, core.Literal) != isinstance(b, core.Literal):
            return [SHAPE] * n
        if isinstance(a, core.Literal) and not _same(a.val, b.val):
            return [COUNT] * n
    if any(len(_dims(tuple(a.aval.shape), tuple(b.aval.shape)) or ()) > 1 for a, b in zip(e1.outvars, e2.outvars)):
        return ["combines every environment with every other (a value with two environment axes)"] * n
    p1, p2 = e1.params, e2.params
    if name == "scan":
        k, c = p1["num_consts"], p1["num_carry"]
        if p1["length"] != p2["length"]:  # over the environments: each step sees one of them, unless it carries
            return _call(p1["jaxpr"], p2["jaxpr"], ins) if c == 0 else \
                ["loops over the environments (a scan along an environment axis, carrying from one to the next)"] * n
        carry = ins[k:k + c]
        for _ in range(c + 1):  # until the carry's reasons settle
            outs = _call(p1["jaxpr"], p2["jaxpr"], ins[:k] + carry + ins[k + c:])
            settled = [a or b for a, b in zip(carry, outs[:c])]
            if settled == carry:
                break
            carry = settled
        return carry + outs[c:]
    if name == "while":
        kc, kb = p1["cond_nconsts"], p1["body_nconsts"]
        carry = ins[kc + kb:]
        for _ in range(len(carry) + 1):
            pred = _call(p1["cond_jaxpr"], p2["cond_jaxpr"], ins[:kc] + carry)[0]
            outs = _call(p1["body_jaxpr"], p2["body_jaxpr"], ins[kc:kc + kb] + carry)
            settled = [pred or a or b for a, b in zip(carry, outs)]
            if settled == carry:
                break
            carry = settled
        return carry
    if name == "cond":
        branches = [_call(b1, b2, ins[1:]) for b1, b2 in zip(p1["branches"], p2["branches"])]
        return [next((r for r in rs if r), None) for rs in zip(*branches)]
    if name == "custom_linear_solve":  # x with matvec(x) = b: per environment where each function it is given is
        b, i, outs = ins[sum(p1["const_lengths"]):], 0, []
        for k, j1, j2 in zip(p1["const_lengths"], p1["jaxprs"], p2["jaxprs"]):
            outs += _call(j1, j2, ins[i:i + k] + b) if j1 is not None else []
            i += k
        return [next((r for r in outs if r), None)] * n
    if p1.get("name") == VOUCHED:  # each environment's row from its own, on the leading axis
        moved = any(_dims(tuple(a.aval.shape), tuple(b.aval.shape)) not in (frozenset(), frozenset({0}))
                    for a, b in zip(e1.invars, e2.invars))
        return ["hands a wrapped environment arrays whose environment axis is not the first"] * n if moved else \
            [None] * n
    body = next((k for k in _CALLS if k in p1), None)
    if body is not None:
        return _call(p1[body], p2[body], ins)
    shapes = [(tuple(a.aval.shape), tuple(b.aval.shape)) for a, b in zip(e1.invars, e2.invars)]
    outs = [(tuple(a.aval.shape), tuple(b.aval.shape)) for a, b in zip(e1.outvars, e2.outvars)]
    dims_in, dims_out = [_dims(*pair) for pair in shapes], [_dims(*pair) for pair in outs]
    if any(d is None for d in dims_in + dims_out):
        return [SHAPE] * n
    return [_rule(name, p1, p2, [s for s, _ in shapes], [s for s, _ in outs], dims_in, dims_out,
                  [t for _, t in shapes])] * n


def _rule(name: str, p1: dict, p2: dict, shape_in: list, shape_out: list, dims_in: list, dims_out: list,
          shape_in2: list) -> str | None:
    """Why one primitive mixes rows, or None. ``shape_*`` are its shapes at N environments, ``dims_*`` the
    environment axes of each operand and result."""
    if not any(dims_in) and not any(dims_out):
        return None
    env = dims_in[0] if dims_in else frozenset()
    along = lambda axes: bool(env & set(axes))  # noqa: E731
    if name in _REDUCE:
        return f"reduces over the environment axis (`{name}`: a sum, mean, max... over environments)" \
            if along(p1["axes"]) else None
    if name in _CUMULATIVE:
        return f"accumulates along the environment axis (`{name}`)" if along([p1["axis"]]) else None
    if name == "sort":
        return "sorts along the environment axis" if along([p1["dimension"]]) else None
    if name == "rev":
        return "reverses the environment axis" if along(p1["dimensions"]) else None
    if name == "stack":
        return "stacks arrays along the environment axis" if p1["axis"] in dims_out[0] else None
    if name == "concatenate":
        return "joins arrays along the environment axis" if p1["dimension"] in dims_out[0] else None
    if name == "split":
        return "splits the environment axis" if along([p1["axis"]]) else None
    if name == "pad":
        return "pads the environment axis" if any(tuple(p1["padding_config"][d]) != (0, 0, 0) for d in env) else None
    if name == "slice":
        whole = all(p["start_indices"][d] == 0 and p["limit_indices"][d] == s[d] and
                    (p["strides"] is None or p["strides"][d] == 1)
                    for p, s in ((p1, shape_in[0]), (p2, shape_in2[0])) for d in env)
        return None if whole else "takes some environments' rows (a slice of the environment axis)"
    if name == "dynamic_slice":
        whole = all(p["slice_sizes"][d] == s[d] for p, s in ((p1, shape_in[0]), (p2, shape_in2[0])) for d in env)
        return None if whole else "takes some environments' rows (a slice of the environment axis)"
    if name == "dynamic_update_slice":
        if dims_in[1] - env:
            return "writes rows of several environments into one array"
        whole = all(shape_in[1][d] == shape_in[0][d] for d in env)
        return None if whole else "writes some environments' rows (an update of part of the environment axis)"
    if name == "iota":
        return "numbers the environments by their position in the replica (an arange along the environment " \
            "axis, as jnp.argsort and ranks over environments make)" if p1["dimension"] in dims_out[0] else None
    if name in ("random_bits", "random_split"):
        drawn = any(d >= len(shape_in[0]) for d in dims_out[0])
        return "draws random numbers for the environments by their position in the replica (one key for all " \
            "environments; per-environment keys come from the global environment index)" if drawn else None
    if name in ("rng_bit_generator", "rng_uniform"):
        return "draws random numbers for the environments by their position in the replica"
    if name == "reshape":
        ok = len(dims_in[0]) == len(dims_out[0]) and all(
            math.prod(shape_in[0][:a]) == math.prod(shape_out[0][:b]) and shape_in[0][a] == shape_out[0][b]
            for a, b in zip(sorted(dims_in[0]), sorted(dims_out[0])))
        return None if ok else "reshapes the environment axis together with another axis"
    if name in ("broadcast_in_dim", "transpose", "squeeze", "expand_dims") or name in _KEYS or name in _IDENTITY:
        return None
    if name == "conv_general_dilated":  # a network's convolution: over each environment's own frames
        dn = p1["dimension_numbers"]
        ok = env <= {dn.lhs_spec[0]} and not dims_in[1] and p1["batch_group_count"] == 1
        return None if ok else "convolves across the environment axis"
    if name.startswith("reduce_window"):  # pooling: a window of one row along the environment axis
        ok = all(p1["window_dimensions"][d] == 1 and p1["window_strides"][d] == 1 and
                 tuple(p1["padding"][d]) == (0, 0) for d in env)
        return None if ok else "pools over the environment axis (a window spanning several environments)"
    if name == "top_k":
        return "takes the top k along the environment axis" if len(shape_in[0]) - 1 in env else None
    if name == "dot_general":
        (lc, rc), _ = p1["dimension_numbers"]
        left, right = dims_in
        if left & set(lc) or right & set(rc):
            return "takes a matrix product over the environment axis"
        return None
    if name == "gather":
        dn, sizes = p1["dimension_numbers"], p1["slice_sizes"]
        for d in env:
            whole = d not in dn.start_index_map and d not in dn.collapsed_slice_dims and sizes[d] == shape_in[0][d]
            if d not in dn.operand_batching_dims and not whole:
                return "indexes the environment axis (rows picked by position in the replica)"
        if env - set(dn.operand_batching_dims) and dims_in[1] - set(dn.start_indices_batching_dims):
            return "combines every environment with every other (an index per environment into all of them)"
        return None
    if name.startswith("scatter"):
        dn = p1["dimension_numbers"]
        if not env:
            return "writes rows of several environments into one array" if any(dims_in[1:]) else None
        window = [d for d in range(len(shape_in[0])) if d not in dn.inserted_window_dims and
                  d not in dn.operand_batching_dims]
        for d in env:
            if d in dn.operand_batching_dims:
                continue
            if d in dn.scatter_dims_to_operand_dims or d not in window or \
                    shape_in[2][dn.update_window_dims[window.index(d)]] != shape_in[0][d]:
                return "writes some environments' rows (an indexed update of the environment axis)"
        return None
    if name == "fft":  # over the last len(fft_lengths) axes
        return "transforms along the environment axis (`fft`)" \
            if any(d >= len(shape_in[0]) - len(p1["fft_lengths"]) for d in env) else None
    if name in _LINALG:
        return None if all(d < len(s) - 2 for s, dims in zip(shape_in, dims_in) for d in dims) else \
            f"solves or factors along the environment axis (`{name}`)"
    out = shape_out[0]
    if name in _ELEMENTWISE and all(s == out for s in shape_out) and all(
            s == () or len(s) == len(out) and all(m in (n, 1) for m, n in zip(s, out)) for s in shape_in):
        return None  # an operand of size 1 along an axis is broadcast
    return f"uses `{name}` on an environment axis, which msrl cannot tell computes each environment's row alone"


_TRUSTING: contextvars.ContextVar[bool] = contextvars.ContextVar("msrl_row_check_trusting", default=False)


def _vouched_call(method: Callable) -> Callable:
    """``method`` traced as one call named :data:`VOUCHED` (its array arguments traced, the rest as given) while
    :func:`trusting` runs; ``method`` itself elsewhere (a copy of the env made meanwhile keeps this)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _TRUSTING.get():
            return method(*args, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        traced = [isinstance(x, jax.Array) for x in leaves]

        def body(*xs: Any) -> Any:
            it = iter(xs)
            a, k = jax.tree.unflatten(tree, [next(it) if t else x for x, t in zip(leaves, traced)])
            return method(*a, **k)

        body.__name__ = VOUCHED
        return jax.jit(body)(*[x for x, t in zip(leaves, traced) if t])

    return call


@contextlib.contextmanager
def trusting(env: Any) -> Iterator[None]:
    """While a user's ``env`` is checked, the envs it wraps (its attributes, and theirs) that msrl vouches for
    (:func:`vouched_rowwise`: its adapters) are taken on trust: their methods are traced as single calls the walk
    does not enter, so a wrapper's own code is checked and an adapter's (a ``done.any()`` cond) is not."""
    patched: list[tuple[Any, str]] = []

    def visit(obj: Any, seen: set[int]) -> None:
        for value in list(vars(obj).values()):
            if not isinstance(value, Environment) or id(value) in seen:
                continue
            seen.add(id(value))
            if not vouched_rowwise(value):
                visit(value, seen)
                continue
            for m in ENV_METHODS:
                if m not in vars(value) and callable(getattr(value, m, None)):
                    setattr(value, m, _vouched_call(getattr(value, m)))
                    patched.append((value, m))

    if isinstance(env, Environment) and env.jittable and not vouched_rowwise(env):
        visit(env, {id(env)})
    token = _TRUSTING.set(True)
    try:
        yield
    finally:
        _TRUSTING.reset(token)
        for value, m in patched:
            delattr(value, m)


def _function(s: Stmt, names: list[str], namespace: dict[str, Any], method: bool) -> Callable:
    """The statement alone as ``f(*values of names) -> what it defines`` (an API call: its arguments; with
    ``method``, an actor's or an env's call: its own method on them)."""
    if s.kind == "compute":
        body, result = ast.unparse(s.node), sorted(d for d in s.defs if not is_state(d))
    elif s.kind == "api" and s.api.component in ("actor", "env") and method:  # its own method, with its state
        c = s.api.component
        args = [f"_s_{c}"] + (["_s_params"] if "params" in s.api.reads else []) + \
            [ast.unparse(a) for a in s.args] + [f"{k}={ast.unparse(v)}" for k, v in s.kwargs]
        body, result = f"_out = _c_{c}.{s.api.method}({', '.join(args)})", ["_out"]
    elif s.kind == "api":
        body, result = "pass", [ast.unparse(a) for a in s.args] + [ast.unparse(v) for _, v in s.kwargs]
    else:  # a return: its value
        body, result = "pass", [] if s.node is None else [ast.unparse(s.node)]
    source = f"def _row_check({', '.join(names)}):\n" + "\n".join("    " + ln for ln in body.splitlines()) + \
        f"\n    return ({', '.join(result)}{',' if result else ''})\n"
    ns = dict(namespace)
    exec(compile(source, f"<msrl row check {s.file}:{s.line}>", "exec"), ns)  # noqa: S102
    return ns["_row_check"]


def _trace(fn: Callable, args: list) -> Any:
    leaves, tree = jax.tree.flatten(args)
    arrays = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

    def call(*xs: Any) -> Any:
        it = iter(xs)
        return fn(*jax.tree.unflatten(tree, [next(it) if a else x for x, a in zip(leaves, arrays)]))

    return jax.make_jaxpr(call)(*[x for x, a in zip(leaves, arrays) if a])


def _untraced(e: Exception) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"cannot be traced alone, at two environment counts, to check that it computes each environment's row " \
        f"alone ({type(e).__name__}: {text})"


def mixing(s: Stmt, values: dict[str, Any], share: dict[str, Any], namespace: dict[str, Any],
           method: bool = False) -> str | None:
    """Why statement ``s`` may mix environments' rows, or None. ``values`` and ``share`` are what it reads
    (shape-dtype structs and Python values) in the loop traced with its N environments and with a replica's
    share (an actor's or an env's call, with ``method``: its method too). One that cannot be traced alone cannot
    be checked, so it counts as mixing."""
    names = sorted(n for n in values if n in share)
    node = getattr(s, "node", None)
    if s.kind == "compute" and (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or isinstance(
            node, ast.Assign) and isinstance(node.value, ast.Lambda)):  # (a TypeError: returned a function)
        free = ", ".join(names) or "values of the loop"
        return (f"defines a function of {free}, known only as the loop runs, which cannot be checked (or sent) as a "
                f"value: give {free} to it as arguments (`lambda x, {free}: ...`), or write its body where it is used")
    try:
        fn = _function(s, names, namespace, method)
    except Exception as e:  # noqa: BLE001 - the loop itself traced; this statement alone did not
        return _untraced(e)
    return mixing_fn(fn, [values[n] for n in names], [share[n] for n in names])


def mixing_fn(fn: Callable, args: list, share: list) -> str | None:
    """Why ``fn(*args)`` may mix environments' rows, or None (``share``: its arguments at a replica's share of
    the environments; shape-dtype structs are traced, other values passed as they are). Where it cannot be
    traced, it cannot be checked: that is the reason."""
    try:
        j1, j2 = _trace(fn, args), _trace(fn, share)
    except Exception as e:  # noqa: BLE001 - any failure: the check cannot vouch for it
        return _untraced(e)
    return next((r for r in _call(j1, j2, [None] * len(j1.jaxpr.invars)) if r), None)
