"""Resolving the user's code: ``"package.module:function"`` factories, or the objects themselves.

From Python, every field that names code (``model``, ``dataset``, ``optimizer``, ``lr_schedule``, ``loss``,
``metrics`` entries, ``train_transform``/``test_transform``, ``callbacks``) also takes the class or
function itself, including one
defined in ``__main__`` or a notebook cell, as Ray Train takes ``train_loop_per_worker``: Ray
pickles it with cloudpickle, by value for ``__main__``, by reference (its module shipped, below)
otherwise. A run folder records such an object as :func:`code_record` (its qualified name and a
hash of its source), so a resume with another object is refused like a changed config.

A factory in the user's own folder imports on the driver (the folder is on ``sys.path``)
but not on Ray workers, which start elsewhere. ``local_modules_to_ship`` finds such
modules so that ``fit`` can send them with the job (Ray's ``py_modules``), as users
expect from Ray's runtime environments.

A factory is code, so two rules keep a config from calling arbitrary functions:

- a standard-library or builtin callable is never a factory (``os:system``,
  ``builtins:eval``, ``subprocess:run``, nor a user module's re-export of one), whoever
  wrote the config;
- a factory named in a config FILE is used only when the caller opts in
  (``TrainConfig.from_yaml(..., allow_code=True)``, CLI ``--allow-code``) or its module is
  listed in ``RAYTRAIN_MGPU_TRUSTED_MODULES`` (comma-separated module prefixes, e.g.
  ``my_models,acme.vision``). A factory given from Python or typed as a CLI option is the
  user's own code and needs neither.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, Tuple

TRUSTED_MODULES_ENV = "RAYTRAIN_MGPU_TRUSTED_MODULES"


HF_MODEL_PREFIX = "hf:"
"""``model="hf:<folder, URI or hub id>"``: a Hugging Face model (``models/huggingface.py``), a name, not code (a
module named ``hf`` is reached as ``package.hf:function``)."""


def is_factory(spec) -> bool:
    """Whether ``spec`` is the user's own code: a ``module:function`` string, or an object from Python."""
    return is_object(spec) or (isinstance(spec, str) and ":" in spec and not spec.startswith(HF_MODEL_PREFIX))


def is_object(spec) -> bool:
    """A class, function or callable instance handed over from Python (not a name)."""
    return callable(spec) and not isinstance(spec, str)


def _named(spec):
    """What names an object: a function or class itself, an instance's class, a partial's function."""
    while isinstance(spec, functools.partial):
        spec = spec.func
    return spec if hasattr(spec, "__qualname__") else type(spec)


def code_name(spec) -> str:
    """``spec`` as messages and reports name it: a string as given, an object's ``module:qualname``."""
    if isinstance(spec, str):
        return spec
    named = _named(spec)
    return f"{getattr(named, '__module__', None) or '?'}:{named.__qualname__}"


def function_name(spec) -> str:
    """The name after the ``:`` (a metric is reported under it), or a registry name as it is."""
    return code_name(spec).split(":", 1)[-1] if is_factory(spec) else spec


def code_record(spec):
    """What a run folder records of ``spec``: a name as it is; an object as
    ``<object module:qualname sha256:...>`` of its source (of its code object where Python has no source,
    e.g. ``python -c``), so that an edited function or another object refuses a resume."""
    if spec is None or isinstance(spec, str):
        return spec
    named = _named(spec)
    try:
        source = inspect.getsource(named)
    except (OSError, TypeError):
        source = _code_text(named)
    if named is not spec and not isinstance(spec, functools.partial):  # an instance: its plain settings too
        source += repr(sorted((k, v) for k, v in vars(spec).items() if isinstance(v, (bool, int, float, str, tuple))
                              or v is None) if hasattr(spec, "__dict__") else spec)
    if isinstance(spec, functools.partial):
        source += repr((spec.args, sorted(spec.keywords.items())))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"<object {code_name(spec)} sha256:{digest}>"


def _is_standard_library(module_name: str) -> bool:
    top = module_name.split(".", 1)[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "builtins"


def check_factory_spec(spec: str, field: str) -> None:
    """Refuse a ``module:function`` in the standard library, without importing anything."""
    module_name = spec.split(":", 1)[0]
    if _is_standard_library(module_name):
        raise ValueError(
            f"TrainConfig.{field}={spec!r}: {module_name!r} is a standard-library module, and a factory must "
            f"be your own function (standard-library callables such as os:system are never factories). "
            f"Name a function in your own module, e.g. 'my_models:build', or a registry name.")


def trusted_modules() -> list:
    """Module prefixes from ``RAYTRAIN_MGPU_TRUSTED_MODULES`` whose factories a config file may name."""
    return [m.strip() for m in os.environ.get(TRUSTED_MODULES_ENV, "").split(",") if m.strip()]


def check_file_factories(values: dict, fields: Iterable[str], source: str, allow_code: bool) -> None:
    """A config file may name a factory only with ``allow_code`` or a trusted module."""
    if allow_code:
        return
    trusted = trusted_modules()
    for field in fields:
        spec = values.get(field)
        if not isinstance(spec, str) or not is_factory(spec):
            continue
        module_name = spec.split(":", 1)[0]
        if any(module_name == t or module_name.startswith(t + ".") for t in trusted):
            continue
        raise ValueError(
            f"{source}: {field}={spec!r} names code to run (module:function), and a config file that names "
            f"code is code. If you trust this file, pass allow_code=True to TrainConfig.from_yaml (CLI: "
            f"--allow-code), or list the module in {TRUSTED_MODULES_ENV}={module_name}; otherwise use a "
            f"registry name.")


def load_factory(spec, field: str) -> Callable:
    """Import ``module:function`` (an object from Python is already the function); errors name the field,
    the module and the fix. An object handed over from Python is the user's own code, as a string typed
    in Python is: the standard-library rule is for names (``functools.partial(build, width=64)`` is fine)."""
    if is_object(spec):
        return spec
    check_factory_spec(spec, field)
    module_name, func_name = spec.split(":", 1)
    # Console scripts do not put the working directory on sys.path; appending it (not
    # prepending: it must not shadow installed packages) makes "run from the folder
    # holding my_models.py" work.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error is the user's to see
        raise ValueError(
            f"TrainConfig.{field}={spec!r}: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc}). Run from the folder that holds "
            f"{module_name.replace('.', '/')}.py, or install the package that provides it (or add "
            f"its folder to PYTHONPATH).") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"TrainConfig.{field}={spec!r}: module {module_name!r} has no function "
                         f"{func_name!r}. Check the name after the ':'.")
    owner = getattr(func, "__module__", None) or ""
    if inspect.isbuiltin(func) or _is_standard_library(owner):
        # e.g. my_module:system after `from os import system` in my_module
        raise ValueError(f"TrainConfig.{field}={spec!r} is {owner or 'a builtin'}.{func_name}, a standard-library "
                         f"or builtin callable, not a factory of yours. Name a function defined in your module.")
    return func


def _code_text(obj) -> str:
    """A function's (a class's methods') bytecode, names and constants, without the addresses and line
    numbers that differ between processes: the record of code that has no source file."""
    if isinstance(obj, (classmethod, staticmethod, property)):
        obj = getattr(obj, "__func__", None) or obj.fget
    if isinstance(obj, type):
        return repr(sorted((name, _code_text(value)) for name, value in vars(obj).items()
                           if callable(value) or isinstance(value, (classmethod, staticmethod, property))))
    code = getattr(obj, "__code__", obj)
    if not hasattr(code, "co_code"):
        return ""
    consts = [_code_text(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return repr((code.co_code, code.co_names, consts))


CODE_FIELDS = ("model", "dataset", "optimizer", "lr_schedule", "loss", "collate", "train_step", "param_groups")
"""The ``TrainConfig`` fields that may name code (a ``module:function``, or from Python the object): the workers get
their modules."""


def _objects(cfg) -> list:
    """``(field, object)`` of every class or function ``cfg`` was given from Python (not by name)."""
    entries = [(name, getattr(cfg, name)) for name in (*CODE_FIELDS, "train_transform", "test_transform")]
    entries += [("metrics", entry) for entry in cfg.metrics or []]
    return [(field, spec) for field, spec in entries if is_object(spec)]


def send_objects_by_value(cfg) -> None:
    """The objects of the user's own modules (those :func:`local_modules_to_ship` would ship) travel by value,
    as ``__main__``'s do: Ray Train's controller unpickles the run's config before any worker starts,
    and only the driver script's folder and working directory are on its path (Ray's
    ``py_driver_sys_path``), not the runtime environment's ``py_modules``. Without this, such a module
    elsewhere stopped the run at the controller's start: ``No module named ...``
    (``tests/test_ray_datasets.py``, whose test module is on pytest's path only)."""
    # late: Ray (0.25 s of import) stays out of the config, which --help and TrainConfig(...) import
    from ray import cloudpickle

    for _, spec in _objects(cfg):
        if local_modules_to_ship(spec):
            cloudpickle.register_pickle_by_value(sys.modules[code_name(spec).split(":", 1)[0].split(".")[0]])


def check_objects_ship(cfg) -> None:
    """Every class or function given from Python pickles as Ray will send it to the workers (cloudpickle,
    after :func:`send_objects_by_value`); one that does not fails here, before Ray, naming it and the fix."""
    from ray import cloudpickle  # late: see send_objects_by_value

    for field, spec in _objects(cfg):
        try:
            cloudpickle.dumps(spec)
        except Exception as exc:  # whatever the object holds that cannot travel
            raise ValueError(
                f"TrainConfig.{field}={code_name(spec)!r} cannot be sent to the Ray workers: pickling it raised "
                f"{type(exc).__name__}: {exc}. Ray sends your objects by value (cloudpickle), with everything "
                f"they refer to: build what cannot travel (locks, open files, clients, CUDA tensors) inside the "
                f"function instead of capturing it, or name a module-level function as 'module:function'.") from exc


def keyword_parameters(func: Callable) -> Tuple[frozenset, bool]:
    """The names ``func`` accepts as keyword arguments, and whether it takes ``**kwargs``.

    A callable whose signature Python cannot read (some C extensions) counts as a catch-all.
    """
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return frozenset(), True
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def local_modules_to_ship(*specs: str) -> list:
    """Top-level packages/modules of user factories that live outside site-packages.

    Returns paths for Ray's ``runtime_env["py_modules"]``: the package folder, or the
    single ``.py`` file, of each factory module imported from the user's own folders.
    """
    installed = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    shipped = []
    for spec in specs:
        if not is_factory(spec):
            continue
        top = code_name(spec).split(":", 1)[0].split(".")[0]
        if top in ("__main__", "?"):  # cloudpickle sends __main__'s objects by value
            continue
        module = sys.modules.get(top) or importlib.import_module(top)
        origin = getattr(module, "__file__", None)
        if origin is None:
            continue
        path = Path(origin).resolve()
        path = path.parent if path.name == "__init__.py" else path
        if any(parent in installed for parent in path.parents) or top == "raytrain_mgpu":
            continue
        if str(path) not in shipped:
            shipped.append(str(path))
    return shipped


def upload_modules(paths: list) -> list:
    """Upload local module paths to the cluster; returns ``gcs://`` URIs for ``py_modules``.

    Ray accepts local paths in ``py_modules`` only in the job-level runtime env given to
    ``ray.init``; a per-run ``worker_runtime_env`` needs URIs. This does the upload step
    ``ray.init`` does (a private Ray function, so it is kept to this one place).
    """
    # late: Ray, as in send_objects_by_value
    import ray
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

    try:
        scratch = ray._private.worker.global_worker.node.get_runtime_env_dir_path()
        env = upload_py_modules_if_needed({"py_modules": list(paths)}, include_gitignore=True, scratch_dir=scratch)
    except Exception as exc:
        raise RuntimeError(
            f"could not ship your modules {paths} to the Ray workers ({type(exc).__name__}: {exc}). "
            f"Install them as a package on every node, or submit with `ray job submit --working-dir .`.") from exc
    return env["py_modules"]
