"""Registries of algorithms, policies and backends.

The core never imports a concrete algorithm, policy or backend: it looks names up here. Built-ins and
installed plug-ins are found through the entry-point groups ``msrl.algorithms``, ``msrl.policies`` and
``msrl.backends``; a user's own class registers with the decorators below (``@msrl.register_algorithm``).
"""

from __future__ import annotations

import importlib
import operator
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from msrl.errors import ConfigError, MsrlError, did_you_mean, quote, user_code_error


class Registry:
    def __init__(self, kind: str, noun: str, key: str, base: str):
        self.kind, self.noun, self.key, self._items = kind, noun, key, {}
        self.base = base  # "module:Class" every registered class subclasses (imported when one registers)
        self._installed: dict[str, Any] | None = None

    def register(self, name: str):
        """A decorator registering its class under ``name``; a name another class holds (registered, or an installed
        entry point) is refused. The same ``module:qualname`` again (a module imported twice) replaces it."""
        def wrap(obj: Any) -> Any:
            module, _, cls = self.base.partition(":")
            base = getattr(importlib.import_module(module), cls)
            if not (isinstance(obj, type) and issubclass(obj, base)):
                raise ConfigError(self.key, f"register_{self.noun}({quote(name)}) decorates a subclass of msrl.{cls}, "
                                  f"got {quote(obj, 80)}")
            if self.noun == "algorithm":
                _check_config_class(obj, name, self.key)
            _check_name_field(obj, name, self.key, self.noun)
            held = self._items.get(name) or self._entry_point_class(name)
            if held is not None and _path(held) != _path(obj):
                raise ConfigError(self.key, f"{quote(name)} is already the {self.noun} {_path(held)}; register "
                                  f"{_path(obj)} under another name")
            self._items[name] = obj
            obj.registered_name = name
            return obj

        return wrap

    def _entry_point_class(self, name: str) -> Any:
        """The class an installed entry point names ``name``, or None. A module being imported (a plug-in whose
        decorator registers the name its own entry point gives) is read as it stands, not imported again."""
        ep = self._entry_points().get(name)
        if ep is None:
            return None
        module = sys.modules.get(ep.module)
        if module is None:
            return _load(ep, self.key, self.noun)
        try:
            return operator.attrgetter(ep.attr)(module)
        except AttributeError:  # not defined yet: the decorator runs inside the module it names
            return None

    def _entry_points(self) -> dict[str, Any]:
        """The installed entry points of this kind, by name; read once per process (each read parses the metadata
        of every installed package: ~40 ms, and every built-in's decorator asks)."""
        if self._installed is None:
            self._installed = {ep.name: ep for ep in entry_points(group=f"msrl.{self.kind}")}
        return self._installed

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._entry_points()))

    def check(self, name: Any) -> None:
        """Refuse a name that is not registered, without loading anything."""
        if not isinstance(name, str):
            article = "an" if self.noun[0] in "aeiou" else "a"
            raise ConfigError(self.key, f"must be the name of {article} {self.noun} (a string), got {quote(name)}; "
                              f"available: {', '.join(self.names())}")
        if name not in self._items and name not in self._entry_points():
            raise ConfigError(self.key, f"unknown {self.noun} {quote(name)}; {did_you_mean(name, self.names())}"
                              f"available: {', '.join(self.names())} (one of your own registers when its module "
                              "is imported: `msrl ... --import FILE.py`, run.imports in the config, or import it "
                              "in Python first)")

    def get(self, name: str) -> Any:
        self.check(name)
        if name not in self._items:
            self.register(name)(_load(self._entry_points()[name], self.key, self.noun))
        return self._items[name]


def _load(ep: Any, key: str, noun: str) -> Any:
    """An installed plug-in's class; where its module fails to import, a ConfigError naming its file:line."""
    try:
        return ep.load()
    except Exception as e:  # the plug-in's own error, reported as one line
        where = f"{ep.dist.name}'s " if getattr(ep, "dist", None) is not None else ""
        raise ConfigError(key, f"the {noun} {quote(ep.name)} ({where}entry point {ep.value}) did not load: "
                          f"{user_code_error(e, ep.module, key).message}") from e


def _check_config_class(obj: type, name: str, key: str) -> None:
    """An algorithm's ``Config`` subclasses msrl.AlgorithmConfig (a plain pydantic model was an AttributeError deep
    in msrl), and each of its defaults is a valid value of its field (``rollout_len: int = 32.5`` trained until a
    ``range()`` of it failed at the loop's line)."""
    from pydantic import ValidationError
    from pydantic_core import PydanticUndefined

    from msrl.algorithm import AlgorithmConfig

    config = getattr(obj, "Config", None)
    if not (isinstance(config, type) and issubclass(config, AlgorithmConfig)):
        raise ConfigError(key, f"register_algorithm({name!r}) of {_path(obj)}: its Config must subclass "
                          f"msrl.AlgorithmConfig (or a built-in's Config), got {quote(config, 80)}")
    defaults = {n: f.default for n, f in config.model_fields.items()
                if n != "name" and f.default is not PydanticUndefined}
    try:
        config.model_validate({**defaults, "name": name})
    except ValidationError as e:
        err = next((x for x in e.errors() if x["loc"] and x["loc"][0] in defaults), None)
        if err is not None:
            raise ConfigError(key, f"register_algorithm({name!r}) of {_path(obj)}: its Config's default "
                              f"{err['loc'][0]}={defaults[err['loc'][0]]!r} is not a valid value of its field: "
                              f"{err['msg']}") from None
    except Exception:  # noqa: BLE001 - a model not fully defined yet: its use will say why
        return


def _check_name_field(obj: type, name: str, key: str, noun: str) -> None:
    """A class whose config (an algorithm's ``Config``, a policy itself) could never hold ``name: NAME`` is refused
    as it registers (a subclass of a built-in keeps its ``Literal["ppo"]``; a config naming it would be refused)."""
    from pydantic import PydanticUserError, ValidationError

    model = getattr(obj, "Config", obj)
    field = getattr(model, "model_fields", {}).get("name")
    if field is None:
        return
    try:
        model.model_validate({"name": name})
    except PydanticUserError:  # not fully defined yet: its use will say why
        return
    except ValidationError as e:
        if all(error["loc"] != ("name",) for error in e.errors()):
            return
        where = f"its own Config, e.g. `class Config({obj.__bases__[0].__name__}.Config): " if model is not obj \
            else "in it `"
        raise ConfigError(key, f"register_{noun}({name!r}) of {_path(obj)}, whose config's name is "
                          f"{field.default!r}: no config could select it; declare {where}name: Literal[{name!r}] = "
                          f"{name!r}`") from None


def _path(obj: Any) -> str:
    """``module:qualname`` of a class or function (what a registration is known by)."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


ALGORITHMS = Registry("algorithms", "algorithm", "algorithm.name", "msrl.algorithm:Algorithm")
POLICIES = Registry("policies", "policy", "policy.name", "msrl.policy:Policy")
BACKENDS = Registry("backends", "backend", "policy.backend", "msrl.backend:Backend")

register_algorithm = ALGORITHMS.register
register_policy = POLICIES.register
register_backend = BACKENDS.register

USER_MODULES: dict[str, str] = {}  # the user's modules imported by --import or run.imports (a .py file's absolute
# path, or a module's name; in order, each with the key that gave it): every process of a run imports them too, and
# the run's config.yaml lists them (run.imports)


def main_script() -> str | None:
    """What Python runs as ``__main__`` (``python my_algorithm.py``: its file; ``python -m pkg.mine``: the module's
    name), where it registered an algorithm, policy, backend or env maker and runs nothing at import but under
    ``if __name__ == "__main__":``: a run lists it in run.imports, so its other processes, msrl eval and --resume
    import it. A script that calls anything at its top level (``msrl.train(...)``) is not listed: importing it would
    run that again (``--import`` it from a command instead)."""
    import ast

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    envs = sys.modules.get("msrl.envs")
    held = [*ALGORITHMS._items.values(), *POLICIES._items.values(), *BACKENDS._items.values(),
            *getattr(envs, "_MAKERS", {}).values()]
    if not path or not path.endswith(".py") or all(getattr(o, "__module__", None) != "__main__" for o in held):
        return None
    try:
        body = ast.parse(Path(path).read_text()).body
    except (OSError, SyntaxError, ValueError):
        return None
    guard = [n for n in body if isinstance(n, ast.If) and {"__name__", "__main__"} <= {
        getattr(x, "id", getattr(x, "value", None)) for x in ast.walk(n.test)}]
    rest = [n for n in body if n not in guard and not isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                                                     ast.AsyncFunctionDef, ast.ClassDef))]
    calls = any(isinstance(x, ast.Call) and not (isinstance(n, ast.Assign | ast.AnnAssign) and _harmless(x))
                for n in rest for x in ast.walk(n))
    if not guard or calls:
        return None
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name != "__main__" else str(Path(path).resolve())


def _harmless(call: Any) -> bool:
    """A call a module's top level may make as it is imported (``Path(__file__).parent``, ``TypeVar("T")``,
    ``logging.getLogger(...)``): one of a few names that only build a value."""
    import ast

    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return name in {"Path", "TypeVar", "getLogger", "namedtuple", "field", "Field", "compile", "partial", "dict",
                    "list", "tuple", "set", "frozenset", "float", "int", "str", "NamedTuple", "register_pytree_node"}


def import_user_module(spec: str, key: str = "--import") -> None:
    """Import the user's module ``spec``, a dotted module name or a .py file (imported by its name from its folder,
    so Ray workers can import it the same way), so that its ``@msrl.register_*`` decorators run; errors name
    ``key``. A file that is gone is skipped where a module of its name was imported already (``--import`` gave
    its new place); a file whose name another module already has (``random.py``) is refused."""
    path, main = Path(spec).expanduser(), sys.modules.get("__main__")
    name = spec
    if spec == getattr(getattr(main, "__spec__", None), "name", None):  # `python -m NAME` runs it: its names are here
        return
    if spec.endswith(".py"):
        name, spec = path.stem, str(path.resolve())
        if getattr(main, "__file__", None) and str(Path(main.__file__).resolve()) == spec:  # the script this runs
            return
        if not path.is_file():
            if name in sys.modules:
                return
            given = [m for m, k in USER_MODULES.items() if k == "--import"]
            if key == "run.imports" and given:  # (moved and renamed, say): what the user gave stands in for it
                print(f"msrl: note: run.imports: {spec} is gone; {', '.join(given)} (--import) "
                      f"stand{'s' * (len(given) == 1)} in for it", file=sys.stderr)
                return
            moved = (" (if it is one a run's config.yaml lists, and it has moved, give --import with its new place, "
                     "or, from Python, msrl.registry.import_user_module(its new place) before msrl.load or msrl.train)")
            relative = f" (a relative path is taken from the working directory, {Path.cwd()})"
            raise ConfigError(key, f"{spec}: no such file" + (relative if not path.is_absolute() else
                                                             moved * (key == "run.imports")))
        if not name.isidentifier():  # (`my.algo.py` was "No module named 'my.algo'; 'my' is not a package")
            better = re.sub(r"\W", "_", name)
            raise ConfigError(key, f"{path}: a module's name cannot hold a dot (or a dash, a space: Python imports "
                              f"the file as module {name!r}); rename it, e.g. {better}.py")
        other = _origin(name)
        if name in sys.stdlib_module_names or other not in (None, spec):
            raise ConfigError(key, f"{spec}: a module named {name!r} exists already ("
                              + ("Python's own" if name in sys.stdlib_module_names else other)
                              + "), so this file would not run, or would hide that module; rename it")
        if str(Path(spec).parent) not in sys.path:
            sys.path.insert(0, str(Path(spec).parent))
    elif path.is_file() or (len(path.parts) > 1 and path.suffix in (".yaml", ".yml", ".json")):  # (a config: it
        # said "No module named ...")
        raise ConfigError(key, f"{spec} is not a .py file: give a Python file of yours (or a module's name)")
    elif not name or name.startswith(".") or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(key, f"{name!r} is neither a .py file nor a module's name")
    if spec in USER_MODULES:
        return
    try:
        importlib.import_module(name)
    except ImportError as e:
        if e.name != name and _find_spec(name) is not None:  # it ran, and an import of its own failed: say where
            raise user_code_error(e, name, key) from e
        here = f" (a file here? write {name}.py)" if Path(f"{name}.py").is_file() else ""
        raise ConfigError(key, f"cannot import {name!r}: {e}{here}") from None
    except MsrlError:
        raise
    except Exception as e:  # the module's own code failed: say where
        raise user_code_error(e, name, key) from e
    USER_MODULES[spec] = key


def _origin(name: str) -> str | None:
    """The resolved file the module ``name`` is (or would be) imported from; None where there is no such module."""
    module = sys.modules.get(name)
    where = (getattr(module, "__file__", None) or "a module without a file") if module is not None else \
        getattr(_find_spec(name), "origin", None)
    return str(Path(where).resolve()) if where and Path(where).is_file() else where


def _find_spec(name: str) -> Any:
    """``importlib.util.find_spec(name)``, None where it cannot say (a parent package that does not import)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
