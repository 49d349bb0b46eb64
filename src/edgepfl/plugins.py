"""Plug-ins: your own algorithms, models and data sets, without editing edgepfl.

A plug-in is a Python module, or a ``.py`` file, that registers what it brings when it is
imported::

    from edgepfl.plugins import register_algorithm, register_dataset, register_model

    register_model("tiny_cnn", TinyCNN, "two 3x3 convolutions and a classifier")
    register_dataset("blobs", load_blobs, "seeded Gaussian blobs, 16 features, 4 classes")
    register_algorithm(ALGORITHM)   # an edgepfl.contract.algorithm.Algorithm

Load it with ``edgepfl run --plugin my_plugin.py`` (repeatable; also on ``compare``,
``sweep``, ``tune`` and ``list``), with ``plugins = ["my_plugin.py"]`` in a configuration,
or, for an installed package, an entry point in the group ``edgepfl.plugins`` (loaded
whenever edgepfl resolves a configuration). A run's config.json records its plug-ins, so
``compare`` and a Flower ServerApp or ClientApp load them again, and ``--resume`` does
when they are given again with ``--plugin`` or ``--trust-plugins`` says so (a run
directory from someone else is code; ``not_trusted``). Names are
checked like built-in ones: a plug-in may not take a name edgepfl or another plug-in
already uses.

A data set's loader is called as ``loader(source)`` with a ``DataSource`` (the data
directory, ``dataset.path`` and the run seed) and returns arrays by name, as an ``npz``
data set holds them: ``x`` (images ``[n, H, W]`` or ``[n, C, H, W]``, or feature vectors
``[n, d]``) and ``y`` (integer labels or class names), optionally ``x_test``/``y_test``,
``client``/``client_test`` (for ``partition.scheme = "natural"``) and ``classes``.
Without a test split, ``dataset.test_fraction`` of the samples is held out.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgepfl.errors import ConfigError
from edgepfl.registered import DataSource, _origin, origin

if TYPE_CHECKING:
    from torch import nn

    from edgepfl.contract.algorithm import Algorithm

PLUGIN_GROUP = "edgepfl.plugins"
__all__ = ["PLUGIN_GROUP", "DataSource", "load_installed", "load_plugins", "origin",
           "register_algorithm", "register_dataset", "register_model"]


DatasetLoader = Callable[[DataSource], Mapping[str, np.ndarray]]
ModelFactory = Callable[[int, int, int], "nn.Module"]

_loaded: dict[str, str] = {}  # resolved spec -> the module it was imported as
_loading: list[str] = []  # the plug-in being imported (registrations are credited to it)
_installed_loaded = False


def _claim(kind: str, name: str, registry: Mapping, obj: object, same: Callable[[], bool]) -> bool:
    """Whether ``name`` is free to register (False: this very object is registered under it
    already, as when a plug-in is imported twice); a taken name is a ConfigError."""
    if not isinstance(name, str) or not name or name != name.strip().lower():
        raise ConfigError(f"a plug-in's {kind} name must be a non-empty lower-case string; "
                          f"got {name!r}")
    if name in registry:
        if same():
            return False
        who = _origin.get((kind, name))
        raise ConfigError(f"plug-in {_current()!r} registers the {kind} {name!r}, which "
                          f"{'plug-in ' + repr(who) if who else 'edgepfl'} already has; "
                          "choose another name")
    _origin[(kind, name)] = _current()
    return True


def _current() -> str:
    return _loading[-1] if _loading else "<code that imported edgepfl.plugins>"


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Make ``algorithm`` (an ``edgepfl.contract.algorithm.Algorithm``) runnable by its name."""
    from edgepfl.algorithms import ALGORITHMS
    from edgepfl.contract.algorithm import Algorithm, Client, Edge, Hyperparameters, Server

    if not isinstance(algorithm, Algorithm):
        raise ConfigError(f"register_algorithm takes an edgepfl.contract.algorithm.Algorithm, "
                          f"got {type(algorithm).__name__}")
    for what, cls, base in (("hyperparameters", algorithm.hyperparameters, Hyperparameters),
                            ("server", algorithm.server, Server),
                            ("client", algorithm.client, Client)):
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"algorithm {algorithm.name!r}: its {what} must be a subclass of "
                              f"{base.__name__}, got {cls!r}")
    if algorithm.edge is not None and not (isinstance(algorithm.edge, type)
                                           and issubclass(algorithm.edge, Edge)):
        raise ConfigError(f"algorithm {algorithm.name!r}: its edge must be a subclass of Edge")
    if _claim("algorithm", algorithm.name, ALGORITHMS, algorithm,
              lambda: ALGORITHMS[algorithm.name] is algorithm):
        ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def register_model(name: str, factory: ModelFactory, description: str, *,
                   variable_size: bool = False) -> None:
    """A model by name: ``factory(channels, num_classes, image_size)`` returns an
    ``nn.Module`` whose layers each own their parameters (``models.layers.LayerSpec``);
    ``variable_size``: its output does not depend on the input's height and width."""
    from edgepfl.models import zoo

    if not callable(factory):
        raise ConfigError(f"model {name!r}: factory must be callable (channels, classes, size)")
    if _claim("model", name, zoo.MODELS, factory, lambda: zoo.MODELS[name][0] is factory):
        zoo.MODELS[name] = (factory, description)
        if variable_size:
            zoo.VARIABLE_SIZE_MODELS.add(name)


def register_dataset(name: str, loader: DatasetLoader, description: str, *,
                     default_model: str = "mlp") -> None:
    """A data set by name, read by ``loader(source)`` (see the module's text);
    ``default_model`` is the model a run takes when ``model.name`` is unset."""
    from edgepfl.data import datasets
    from edgepfl.models import zoo

    if not callable(loader):
        raise ConfigError(f"data set {name!r}: loader must be callable (DataSource -> arrays)")
    if _claim("dataset", name, datasets.DATASETS, loader,
              lambda: datasets.PLUGIN_LOADERS.get(name) is loader):
        datasets.DATASETS[name] = description
        datasets.PLUGIN_LOADERS[name] = loader
        zoo.DEFAULT_MODEL[name] = default_model


def load_plugins(specs: Iterable[str]) -> None:
    """Import every plug-in of ``specs`` (module names, or paths of ``.py`` files) once,
    and the installed ones (``load_installed``)."""
    load_installed()
    for spec in specs:
        _load(str(spec))


def load_installed() -> None:
    """The plug-ins installed packages name in the ``edgepfl.plugins`` entry-point group
    (a module, registering on import, or a function to call), once a process."""
    global _installed_loaded
    if _installed_loaded:
        return
    _installed_loaded = True
    for point in entry_points(group=PLUGIN_GROUP):
        _loading.append(f"{point.name} ({point.value})")
        try:
            target = point.load()
            if callable(target):
                target()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"the installed plug-in {point.name!r} ({point.value}) failed "
                              f"to load: {type(exc).__name__}: {exc}") from exc
        finally:
            _loading.pop()


def _load(spec: str) -> None:
    path = Path(spec).expanduser()
    is_file = spec.endswith(".py") or path.suffix == ".py" or "/" in spec or path.is_file()
    key = str(path.resolve()) if is_file else spec
    if key in _loaded:
        return
    _loading.append(spec)
    try:
        if is_file:
            if not path.is_file():
                raise ConfigError(f"plug-in {spec!r}: no such file (from {Path.cwd()}); give "
                                  "the path of a .py file or the name of an importable module")
            name = f"edgepfl_plugin_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:  # no loader for its suffix
                raise ConfigError(f"plug-in {spec!r}: {path} is not a Python source file")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            name = spec
            try:
                importlib.import_module(spec)
            except ModuleNotFoundError as exc:
                if exc.name != spec.split(".")[0] and exc.name != spec:
                    raise
                raise ConfigError(f"plug-in {spec!r}: no module of that name is importable, "
                                  "and it is not a .py file") from None
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"plug-in {spec!r} failed to load: {type(exc).__name__}: {exc}") \
            from exc
    finally:
        _loading.pop()
    _loaded[key] = name


def _key(spec: str) -> str:
    """The key a plug-in is imported under (``_loaded``): a file by its resolved path."""
    path = Path(spec).expanduser()
    is_file = spec.endswith(".py") or path.suffix == ".py" or "/" in spec or path.is_file()
    return str(path.resolve()) if is_file else spec


def is_loaded(spec: str) -> bool:
    """Whether importing ``spec`` again would run nothing: this process has loaded it as a
    plug-in, or (a module) imported it already."""
    key = _key(str(spec))
    return key in _loaded or (key == spec and spec in sys.modules)


def not_trusted(specs: Iterable[str], trusted: Iterable[str] = ()) -> list[str]:
    """The plug-ins of ``specs`` that loading would import for the first time and that are
    not among ``trusted`` (those given on the command line): the code a stored
    configuration would run unasked."""
    given = {_key(str(t)) for t in trusted}
    return [str(s) for s in specs if not is_loaded(str(s)) and _key(str(s)) not in given]


def recorded(specs: Iterable[str]) -> list[str]:
    """Plug-in specs as a configuration records them: a file by its absolute path (a run
    resumed from another folder finds it), a module by its name; each once."""
    out: list[str] = []
    for spec in specs:
        path = Path(spec).expanduser()
        text = str(path.resolve()) if (spec.endswith(".py") or path.is_file()) else spec
        if text not in out:
            out.append(text)
    return out
