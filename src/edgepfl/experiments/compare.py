"""Several algorithms on the same federation: same partition, same client sequence.

Both follow from the seed alone (partition and sampling never draw from an algorithm's
randomness), so running each algorithm with the same seed is what makes them comparable,
and what makes the per-seed difference against a reference algorithm meaningful
(``report.stats``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from edgepfl.algorithms import get_algorithm
from edgepfl.config import Config, build_config, set_dotted
from edgepfl.engine.rundir import run_dir_lock
from edgepfl.engine.simulation import resolve
from edgepfl.errors import EdgepflError
from edgepfl.experiments.runs import Finished, PlannedRun, check_jobs, run_all
from edgepfl.io import write_bytes_atomic, write_csv
from edgepfl.plotting import partition_words, setting_line
from edgepfl.report import stats
from edgepfl.report.plots import plot_curves, seed_curves

# one row per run; these columns are what the table had before its statistics were added,
# kept in their order for whoever reads the file by position
RUN_COLUMNS = ["algorithm", "model", "seed", "acc_mean_best", "best_round", "acc_mean_final",
               "acc_weighted_final", "acc_std_final", "acc_min_final",
               "acc_client_best_mean", "acc_mean_selected_best",
               "acc_client_best_selected_mean", "bytes_up_total",
               "bytes_down_total", "wall_time_s", "run_dir",
               # with eval.validation: the test figure at the round the validation split
               # picked, which no test sample chose (empty without a validation split)
               "val_best_round", "acc_mean_at_val_best", "acc_client_at_val_best_mean"]
# the figures with statistics over seeds and a paired difference against the reference
STAT_FIGURES = ("acc_mean_best", "acc_mean_final", "acc_mean_at_val_best")
STAT_COLUMNS = ["reference", "n_seeds"] + [
    c for fig in STAT_FIGURES
    for c in [*stats.column_names(fig), f"{fig}_diff", *stats.column_names(f"{fig}_diff")]
    if c != f"{fig}_diff_sd"]
COMPARISON_COLUMNS = RUN_COLUMNS + STAT_COLUMNS
# with eval.new_clients only (a comparison without keeps the columns it always had): the
# held-out clients' mean accuracy, empty for a method that cannot serve a new client
NEW_CLIENT_COLUMNS = ["acc_new_mean_best", "acc_new_mean_final", "acc_new_min_final"]
CANNOT_SERVE = "n/a — cannot serve a new client"


def default_reference(algorithms: list[str]) -> str:
    return "fedavg" if "fedavg" in algorithms else algorithms[0]


def pick_reference(algorithms: list[str], reference: str | None) -> str:
    """The algorithm every other is paired with: ``reference``, else FedAvg where it is
    compared (the usual baseline), else the first one."""
    if reference is None:
        return default_reference(algorithms)
    if reference not in algorithms:
        raise EdgepflError(f"--reference {reference!r} is not among the compared algorithms "
                           f"({', '.join(algorithms)}); name one of them, or leave it out for "
                           f"{default_reference(algorithms)}")
    return reference


def split_hyperparameters(base: Config, algorithms: list[str]) -> dict[str, dict]:
    """Hyperparameters per algorithm from ``algorithm.*`` settings.

    ``algorithm.<name>.<key>`` applies to that algorithm only; a plain ``algorithm.<key>``
    applies to every compared algorithm that has such a hyperparameter. A setting that no
    compared algorithm accepts is an error rather than silently dropped.
    """
    from edgepfl.algorithms import get_algorithm
    from edgepfl.errors import ConfigError

    given = base.algorithm.hyperparameters()
    per_algo = {name: dict(given.pop(name)) for name in algorithms
                if isinstance(given.get(name), dict)}
    out = {}
    for name in algorithms:
        fields = get_algorithm(name).hyperparameters.model_fields
        out[name] = {k: v for k, v in given.items() if k in fields}
        out[name].update(per_algo.get(name, {}))
    unused = [k for k in given if not any(k in get_algorithm(a).hyperparameters.model_fields
                                          for a in algorithms)]
    if unused:
        raise ConfigError(f"algorithm.{unused[0]} is a hyperparameter of none of "
                          f"{', '.join(algorithms)}; use algorithm.<name>.<key> for one of them")
    return out


def algorithm_configs(base: Config, algorithms: list[str],
                      settings: dict[str, dict] | None = None
                      ) -> tuple[dict[str, Config], list[str]]:
    """Each algorithm's resolved configuration: the base, its own hyperparameters
    (``split_hyperparameters``) and model (``algorithm.<name>.model``), then ``settings``
    (a study's best); and the star methods that run without the base's edges."""
    configs, star = {}, []
    for name, hp in split_hyperparameters(base, algorithms).items():
        data = base.model_dump()
        model = hp.pop("model", None)
        if model is not None:
            data["model"] = {**data["model"], "name": model}
        data["algorithm"] = {"name": name, **hp}
        if get_algorithm(name).edge is None and data["topology"]["edges"] > 0:
            # a star method beside hierarchical ones: the same clients and data, no edges
            data["topology"] = {**data["topology"], "edges": 0, "parents": []}
            star.append(name)
        for key, value in (settings or {}).get(name, {}).items():
            set_dotted(data, key, value, f"{name}'s tuned {key}")
        configs[name] = resolve(build_config(data))
    return configs, star


def _say_what_differs(configs: dict[str, Config], star: list[str], base: Config,
                      echo: Callable[[str], None]) -> None:
    if star:
        echo(f"note: {', '.join(star)} {'runs' if len(star) == 1 else 'run'} on the same "
             f"clients as a star, without the {base.topology.edges} edges")
    models = {name: cfg.model.name for name, cfg in configs.items()}
    if len(set(models.values())) > 1:
        echo("note: the algorithms run different models (" +
             ", ".join(f"{n}: {m}" for n, m in models.items()) +
             "); --set model.name=... gives them all the same one, "
             "--set algorithm.<name>.model=... one of them its own")


def check_runnable(configs: dict[str, Config]) -> None:
    """Build every algorithm's parts on its data before any run starts, so that one that
    cannot run (a model that does not take the images, a star method given edges) stops
    the comparison before the others have spent their time."""
    from edgepfl.engine.parts import Parts
    from edgepfl.errors import ConfigError
    from edgepfl.experiments.runs import federation_of

    for name, cfg in configs.items():
        try:
            federation = federation_of(cfg)
            Parts.build(cfg, federation["dataset"], federation["partition"].num_clients)
        except ConfigError as exc:
            raise ConfigError(f"{name} cannot run in this comparison: {exc}") from None


def compare(base: Config, algorithms: list[str], seeds: list[int], out: Path,
            progress: bool | None = None, echo: Callable[[str], None] = print, *,
            jobs: int = 1, threads: int | None = None,
            reference: str | None = None, settings: dict[str, dict] | None = None,
            tuned: dict[str, str] | None = None) -> list[dict]:
    """Every algorithm with every seed into ``out/<algorithm>-seed<k>`` (``jobs`` at a
    time, resumable: ``experiments.runs``), then comparison.csv, .md and .png. Everything the
    user gave is checked before the first run starts. Returns the table's rows.

    ``settings``: per algorithm, dotted settings applied over the base and its --set (a
    study's best, ``experiments.tune``); ``tuned``: per algorithm, what it was tuned with, for
    the table, which then says of every algorithm whether it was tuned."""
    with run_dir_lock(out, "comparison"):  # one compare writes its folder at a time
        return _compare(base, algorithms, seeds, out, progress, echo, jobs=jobs,
                        threads=threads, reference=reference, settings=settings, tuned=tuned)


def _compare(base: Config, algorithms: list[str], seeds: list[int], out: Path,
             progress: bool | None, echo: Callable[[str], None], *, jobs: int,
             threads: int | None, reference: str | None, settings: dict[str, dict] | None,
             tuned: dict[str, str] | None) -> list[dict]:
    if not algorithms:
        raise EdgepflError("--algorithms is empty; give a comma-separated list, e.g. local,fedavg")
    reference = pick_reference(algorithms, reference)
    check_jobs(jobs)
    if (out / "comparison.csv").exists():
        raise EdgepflError(f"{out} already holds a comparison; choose another --out")
    configs, star = algorithm_configs(base, algorithms, settings)
    check_runnable(configs)
    _say_what_differs(configs, star, base, echo)
    # seed by seed, so that the runs sharing a seed's data set follow one another
    plan, of = [], {}
    for seed in seeds:
        for name in algorithms:
            run = PlannedRun(f"{name}-seed{seed}",
                             build_config({**configs[name].model_dump(), "seed": seed}))
            plan.append(run)
            of[run.name] = (name, seed)

    def finished(run: PlannedRun, result: Finished) -> None:
        name, seed = of[run.name]
        s = result.summary
        new = ("" if "new_clients" not in s else
               f"new clients {_pct(s.get('acc_new_mean_final'))}, "
               if s.get("new_clients_refused") is None else "new clients n/a, ")
        echo(f"{name:>10} seed {seed}: best {_pct(s.get('acc_mean_best'))} (round "
             f"{s.get('best_round')}), final {_pct(s.get('acc_mean_final'))} ± "
             f"{_pct(s.get('acc_std_final'))} across clients, {new}"
             f"up {s['bytes_up_total'] / 1e6:.2f} MB, down {s['bytes_down_total'] / 1e6:.2f} MB")

    results = run_all(plan, out, jobs=jobs, threads=threads, progress=progress,
                      on_finished=finished, echo=echo)
    rows = with_statistics([_row(run, *of[run.name], results[run.name].summary)
                            for run in plan], algorithms, reference)
    columns = COMPARISON_COLUMNS
    if base.eval.new_clients:
        columns = [*columns, *NEW_CLIENT_COLUMNS]
    if tuned is not None:
        # only then: a table without tuning keeps the columns it always had
        columns = [*columns, "tuned"]
        rows = [{**r, "tuned": tuned.get(r["algorithm"], "")} for r in rows]
    write_csv(out / "comparison.csv", columns, rows)
    write_bytes_atomic(out / "comparison.md",
                       comparison_markdown(rows, algorithms, base, reference, tuned,
                                           star).encode())
    plot_curves({name: seed_curves([results[run.name].curve for run in plan
                                    if of[run.name][0] == name]) for name in algorithms},
                out / "comparison.png",
                "mean accuracy over the seeds (band: ± sample std over seeds)"
                if len(seeds) > 1 else "mean accuracy",
                setting=setting_line(base.model_dump()))
    return rows


def _row(run: PlannedRun, name: str, seed: int, summary: dict) -> dict:
    return {**{k: summary.get(k) for k in RUN_COLUMNS + NEW_CLIENT_COLUMNS},
            "algorithm": name, "seed": seed,
            "model": run.config.model.name, "run_dir": run.name}


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def with_statistics(rows: list[dict], algorithms: list[str], reference: str) -> list[dict]:
    """The per-run rows with their algorithm's figures over seeds (mean, sample std,
    t-interval) and, but for the reference's own rows, the run's difference to the
    reference's run of the same seed, with that difference's mean and t-interval."""
    ref = {r["seed"]: r for r in rows if r["algorithm"] == reference}
    out = []
    for name in algorithms:
        sel = [r for r in rows if r["algorithm"] == name]
        extra: dict = {"reference": reference, "n_seeds": len(sel)}
        for fig in STAT_FIGURES:
            extra.update(stats.columns(fig, stats.estimate(r[fig] for r in sel)))
            if name != reference:
                paired = stats.paired_estimate({r["seed"]: r[fig] for r in sel},
                                               {k: r[fig] for k, r in ref.items()})
                extra.update({k: v for k, v in stats.columns(f"{fig}_diff", paired).items()
                              if k != f"{fig}_diff_sd"})
        for r in sel:
            diffs = {}
            if name != reference and r["seed"] in ref:
                for fig in STAT_FIGURES:
                    d = stats.paired_differences({0: r[fig]}, {0: ref[r["seed"]][fig]})
                    diffs[f"{fig}_diff"] = d.get(0)
            out.append({**r, **extra, **diffs})
    return out


def comparison_markdown(rows: list[dict], algorithms: list[str], base: Config,
                        reference: str | None = None, tuned: dict[str, str] | None = None,
                        star: list[str] | tuple[str, ...] = ()) -> str:
    """comparison.md: the setting, one row per algorithm with its spread and interval over
    the seeds, what was tuned, and each algorithm against the reference seed by seed.
    ``star``: star methods that ran on the hierarchy's clients without its edges."""
    reference = reference or default_reference(algorithms)
    seeds = sorted({r["seed"] for r in rows})
    lines = _header(base, seeds, star) + _accuracy_table(rows, algorithms, base, tuned)
    if tuned is not None:
        lines += ["", "## Tuning", "",
                  "Whether each algorithm ran at the best setting of a study on the validation "
                  "split (edgepfl tune), applied over the settings above, or at its defaults.",
                  "", "| algorithm | settings |", "|---|---|"]
        lines += [f"| {name} | {tuned.get(name) or 'defaults (no study given)'} |"
                  for name in algorithms]
    others = [name for name in algorithms if name != reference]
    if others:
        lines += _paired_table(rows, others, reference, several=len(seeds) > 1,
                               validation=bool(base.eval.validation))
    return "\n".join(lines) + "\n"


def _header(base: Config, seeds: list[int], star: list[str] | tuple[str, ...]) -> list[str]:
    several = len(seeds) > 1
    edges = base.topology.edges
    return [
        f"# Comparison on {base.dataset.name}",
        "",
        f"{base.partition.clients} clients, partition "
        f"{partition_words(base.partition.model_dump())}, {base.train.rounds} rounds, participation "
        f"{base.train.participation}, seeds {', '.join(map(str, seeds))}"
        + (f", {edges} edges" if edges else "") + ". "
        + (f"{', '.join(star)} (star methods) ran on the same clients and data as a star, "
           "without the edges. " if star else "")
        + ("Each cell is the mean ± the sample standard deviation (ddof = 1) over the seeds; "
           "*95% CI* is Student's t-interval for the mean over the seeds. "
           if several else
           "One seed, so no spread over seeds and no interval (n/a); more seeds with "
           "--seeds. ")
        + "Accuracy is the unweighted mean over clients of each client's personalized model "
        "on its own test split. *Best* is the best round (the papers' protocol), *final* "
        "the last.",
        "*Each client's best* averages every client's own best round (KAPC Sec. 7.1's protocol "
        "for Local and FedAvg); with participation below 1, *selected* takes each round's mean "
        "over the clients selected in it (KAPC's client-selection scenario). The paper's "
        "protocols can only flatter; the first columns are ours."
        + (f" *New clients*: the {base.eval.new_clients:g} share of the clients held out of "
           "training (eval.new_clients, the same clients for every algorithm at a seed), each "
           "served as its method would serve a newcomer (e.g. the global model fine-tuned "
           f"for eval.new_client_epochs = {base.eval.new_client_epochs}) and scored on its "
           "test split; they are in no other column." if base.eval.new_clients else ""),
        "",
    ]


def _accuracy_table(rows: list[dict], algorithms: list[str], base: Config,
                    tuned: dict[str, str] | None) -> list[str]:
    partial = base.train.participation < 1
    validation = bool(base.eval.validation)
    new = bool(base.eval.new_clients)
    lines = [
        "| algorithm | model | "
        + ("mean acc at validation's best round | its 95% CI | " if validation else "")
        + "best mean acc | best 95% CI | final mean acc | final 95% CI | "
        + ("new clients' best mean acc | new clients' final mean acc | " if new else "")
        + "final std across clients | final worst client | each client's best | "
        + ("best over selected | " if partial else "") + "MB up | MB down |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if validation else "")
        + ("---|---|" if new else "") + ("---|" if partial else "") + "---|---|",
    ]
    for name in algorithms:
        sel = [r for r in rows if r["algorithm"] == name]

        def est(key, scale=100.0, sel=sel):
            return stats.estimate(r[key] * scale if r[key] is not None else None for r in sel)

        def cell(key, scale=100.0):
            return stats.mean_sd_text(est(key, scale))

        selected = f"{cell('acc_mean_selected_best')} | " if partial else ""
        label = f"{name} (tuned)" if tuned and name in tuned else name
        picked = (f"{cell('acc_mean_at_val_best')} | "
                  f"{stats.interval_text(est('acc_mean_at_val_best'))} | " if validation else "")
        served = "" if not new else (
            f"{CANNOT_SERVE} | {CANNOT_SERVE} | " if get_algorithm(name).no_new_clients
            else f"{cell('acc_new_mean_best')} | {cell('acc_new_mean_final')} | ")
        lines.append(f"| {label} | {sel[0]['model']} | {picked}{cell('acc_mean_best')} | "
                     f"{stats.interval_text(est('acc_mean_best'))} | {cell('acc_mean_final')} | "
                     f"{stats.interval_text(est('acc_mean_final'))} | {served}"
                     f"{cell('acc_std_final')} | {cell('acc_min_final')} | "
                     f"{cell('acc_client_best_mean')} | {selected}"
                     f"{cell('bytes_up_total', 1e-6)} | {cell('bytes_down_total', 1e-6)} |")
    note = ("" if not validation else
            " *At validation's best round*: the test accuracy of the round at which the mean "
            "accuracy on the clients' validation splits (eval.validation) was highest, a "
            "round no test sample picked; *best* is the best round on test (the papers' "
            "protocol), which favours noisy runs and runs with many evaluated rounds.")
    return [*lines, "", "Accuracies in %." + note]


def _paired_table(rows: list[dict], others: list[str], reference: str,
                  several: bool, validation: bool = False) -> list[str]:
    lines = [
        "",
        f"## Against {reference}, seed by seed",
        "",
        f"Each run minus the {reference} run of the same seed (the same partition and "
        "client sequence), in percentage points: "
        + ("the mean of these differences over the seeds and its 95% t-interval. Pairing "
           "takes out what a seed does to every algorithm alike (an easy or a hard "
           "partition), which the two algorithms' intervals side by side still hold; an "
           "interval that excludes 0 is a difference these seeds support."
           if several else "one seed's difference, with no interval (n/a)."),
        "",
        f"| algorithm | seeds | best mean acc − {reference} | 95% CI | "
        f"final mean acc − {reference} | 95% CI |"
        + (f" at validation's best round − {reference} | 95% CI |" if validation else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if validation else ""),
    ]
    ref = {r["seed"]: r for r in rows if r["algorithm"] == reference}
    for name in others:
        sel = {r["seed"]: r for r in rows if r["algorithm"] == name}
        cells, pairs = [], 0
        for fig in STAT_FIGURES:
            if fig == "acc_mean_at_val_best" and not validation:
                continue
            paired = stats.paired_estimate({k: r[fig] for k, r in sel.items()},
                                           {k: r[fig] for k, r in ref.items()})
            pairs = pairs or paired.n  # the seeds both runs finished: what the interval is of
            cells += [stats.mean_text(paired, 100, signed=True),
                      stats.interval_text(paired, 100, signed=True)]
        lines.append(f"| {name} | {pairs} | " + " | ".join(cells) + " |")
    return lines
