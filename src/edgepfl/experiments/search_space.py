"""What a study searches: the ranges of ``--space``, the algorithms' own, and their text.

Apart from running the study (``experiments.tune``) because every range is read and checked
against the base configuration before the first trial, without Optuna; and because the
text a range or a value is written in (``spec_text``, ``value_text``) is what a study
records and what its best.json hands to ``--set``, so it must read back the same.
"""

from __future__ import annotations

import copy
import json
import math
import typing
from collections.abc import Iterable
from typing import Any

from edgepfl.algorithms import get_algorithm
from edgepfl.config import TrainConfig, build_config, parse_value, set_dotted
from edgepfl.contract.algorithm import Choice, IntRange, LogUniform, SearchRange, Uniform
from edgepfl.engine.rundir import EXECUTION
from edgepfl.errors import ConfigError

# searched for every algorithm that reads it (``Hyperparameters.not_searched``). Not
# train.local_epochs: more local work per round buys accuracy with compute, so a search
# on accuracy alone would take the most it is offered, and methods tuned that way would
# be compared at different costs
TRAIN_SPACE: dict[str, SearchRange] = {"train.lr": LogUniform(0.001, 0.3)}
SPACE_FORMS = ("KEY=loguniform:LOW:HIGH (0 < LOW < HIGH), KEY=uniform:LOW:HIGH (LOW < HIGH), "
               "KEY=int:LOW:HIGH (whole numbers, LOW < HIGH) or KEY=choice:A,B,... (at least "
               "two values, each read as --set reads one), KEY a train.* or algorithm.* setting")


def parse_space(items: Iterable[str]) -> dict[str, SearchRange]:
    """``--space`` values (``KEY=KIND:...``) as {dotted key: range}."""
    out: dict[str, SearchRange] = {}
    for item in items:
        key, rng = parse_space_item(item)
        if key in out:
            raise ConfigError(f"--space names {key} twice ({spec_text(out[key])} and "
                              f"{spec_text(rng)}); give each setting one range")
        out[key] = rng
    return out


def parse_space_item(item: str) -> tuple[str, SearchRange]:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"--space {item!r}: {why}; valid forms: {SPACE_FORMS}")

    key, sep, spec = item.partition("=")
    key, spec = key.strip(), spec.strip()
    if not sep or not key or not spec:
        raise bad("not of the form KEY=KIND:...")
    if "." not in key or any(not part for part in key.split(".")):
        raise bad(f"{key!r} is not a dotted setting such as train.lr or algorithm.mu")
    kind, _, args = spec.partition(":")
    kind = kind.strip().lower()
    try:
        if kind in ("loguniform", "uniform"):
            ends = args.split(":")
            if len(ends) != 2:
                raise bad(f"{kind} takes two numbers, LOW:HIGH")
            try:
                low, high = (float(v) for v in ends)
            except ValueError:
                raise bad(f"{kind}'s LOW and HIGH must be numbers") from None
            if not (math.isfinite(low) and math.isfinite(high)):
                raise bad(f"{kind}'s LOW and HIGH must be finite numbers")
            return key, (LogUniform if kind == "loguniform" else Uniform)(low, high)
        if kind == "int":
            ends = args.split(":")
            if len(ends) != 2:
                raise bad("int takes two whole numbers, LOW:HIGH")
            try:
                low_i, high_i = (int(v) for v in ends)
            except ValueError:
                raise bad("int's LOW and HIGH must be whole numbers") from None
            return key, IntRange(low_i, high_i)
        if kind == "choice":
            values = [v.strip() for v in args.split(",")]
            if any(not v for v in values):
                raise bad("choice lists values separated by commas, none of them empty")
            return key, Choice(tuple(parse_value(v) for v in values))
    except ValueError as exc:  # the range's own check: reversed, too few values, ...
        raise bad(str(exc)) from None
    raise bad(f"unknown kind {kind!r}")


def spec_text(rng: SearchRange) -> str:
    """A range as ``--space`` writes it."""
    if isinstance(rng, Choice):
        return "choice:" + ",".join(value_text(v) for v in rng.options)
    kind = {LogUniform: "loguniform", Uniform: "uniform", IntRange: "int"}[type(rng)]
    return f"{kind}:{rng.low!r}:{rng.high!r}"


def value_text(value: Any) -> str:
    """``value`` as --set reads it back: TOML, and a string quoted where it would read as
    something else (``"1"``, ``"true"``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    return text if parse_value(text) == text and "," not in text else json.dumps(text)


def default_space(algorithm: str) -> dict[str, SearchRange]:
    """The common space, less what the algorithm does not read, and the algorithm's own
    (where it names a train.* setting, its range replaces the common one)."""
    hp = get_algorithm(algorithm).hyperparameters
    space = {k: v for k, v in TRAIN_SPACE.items() if k not in hp.not_searched}
    for key, rng in hp.search_space.items():
        space[key if "." in key else f"algorithm.{key}"] = rng
    return space


def search_space(base: dict, algorithm: str, given: dict[str, SearchRange],
                 fixed: Iterable[str] = ()) -> dict[str, SearchRange]:
    """What a study searches: ``default_space`` without the settings ``fixed`` by --set,
    ``given`` (--space) on top; every range checked against ``base`` (a configuration as
    a dict) before the first trial."""
    fixed = {k.strip() for k in fixed}
    clash = sorted(fixed & set(given))
    if clash:
        raise ConfigError(f"{clash[0]} is both fixed (--set) and searched (--space); drop one "
                          "of the two")
    space = {k: v for k, v in default_space(algorithm).items() if k not in fixed}
    space.update(given)
    if not space:
        raise ConfigError(f"nothing to search for {algorithm}: --set fixes every setting of its "
                          f"space; search one with --space, e.g. --space "
                          f"train.lr={spec_text(TRAIN_SPACE['train.lr'])}")
    for key, rng in space.items():
        what = (f"--space {key}={spec_text(rng)}" if key in given
                else f"{algorithm}'s search space ({key}={spec_text(rng)})")
        check_range(base, algorithm, key, rng, what,
                    "" if key in given else f"; narrow the range with --space {key}=..., or fix "
                    f"the setting with --set {key}=...")
    return space


def check_range(base: dict, algorithm: str, key: str, rng: SearchRange, what: str,
                hint: str = "") -> None:
    """``key`` is a setting a search may vary, of a type the range fits, and every end of
    the range (every value of a choice) makes a valid configuration of ``base``."""
    from edgepfl.engine.parts import resolve

    section, _, name = key.partition(".")
    hp = get_algorithm(algorithm).hyperparameters
    if section == "train":
        fields = TrainConfig.model_fields
        if name not in fields:
            raise ConfigError(f"{what}: {key} is not a train setting; valid: "
                              f"{', '.join(fields)}")
        if name == "rounds":
            raise ConfigError(f"{what}: train.rounds is the budget, not a hyperparameter (the "
                              "best round of a longer run can only be as good or better); fix "
                              "it with --set")
        if name in EXECUTION:
            raise ConfigError(f"{what}: {key} says how a run executes, not what it computes; "
                              "fix it with --set")
    elif section == "algorithm":
        fields = hp.model_fields
        if name not in fields:
            raise ConfigError(f"{what}: {name} is not a hyperparameter of {algorithm}; valid: "
                              f"{', '.join(fields) or '(none)'}")
    else:
        raise ConfigError(f"{what}: a search varies how a method trains (train.*) and the "
                          f"method's own settings (algorithm.*); {key} is neither")
    kinds = _types(fields[name].annotation)
    if isinstance(rng, LogUniform | Uniform) and kinds and kinds <= {int}:
        raise ConfigError(f"{what}: {key} takes whole numbers; use int:LOW:HIGH")
    for value in rng.ends():
        data = copy.deepcopy(base)
        set_dotted(data, key, value, what)
        try:
            resolve(build_config(data))
        except ConfigError as exc:
            raise ConfigError(f"{what}: {key} = {value!r} is not a valid setting{hint}:\n  "
                              + str(exc).replace("\n", "\n  ")) from None


def _types(annotation: Any) -> set[type]:
    """The plain types an annotation admits (``int | None`` -> {int})."""
    if isinstance(annotation, str):  # a postponed annotation pydantic left as text
        return set()
    args = typing.get_args(annotation)
    found = set(args) if args else {annotation}
    return {t for t in found if isinstance(t, type) and t is not type(None)}
