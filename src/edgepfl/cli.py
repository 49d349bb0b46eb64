"""The ``edgepfl`` command line: run, compare, sweep, tune, report, list."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import click

from edgepfl.errors import EdgepflError


def _user_errors(on_interrupt: str | Callable[[], str]):
    """Bad input -> one readable message on stderr and exit code 2, no traceback;
    ``on_interrupt`` says how to go on after Ctrl-C (a function: asked then)."""
    def how() -> str:
        return on_interrupt() if callable(on_interrupt) else on_interrupt

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BrokenPipeError:  # the reader went away (| head): no traceback, no
                # "error", but the status a pipe's writer gets (141), and for a command cut
                # off part-way, how to go on
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                if how():
                    click.echo(f"output closed; {how()}", err=True)
                sys.exit(141)
            except (EdgepflError, OSError) as exc:  # OSError: an unwritable folder, a full disk
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
            except KeyboardInterrupt:
                click.echo(f"interrupted; {how()}", err=True)
                sys.exit(130)
        return wrapper
    return decorate


# the run directory of the command running in this process, for the Ctrl-C message;
# "ray": the directory of a --runtime ray run, which starts new runs only
_RUN_DIR: dict[str, Path] = {}


def _how_to_resume(run_dir: Path | None) -> str:
    if run_dir is not None and not (run_dir / "config.json").exists():
        return "nothing of the run was kept: the same command starts it again"
    if run_dir is None:  # stopped before the run had a directory
        return "no run was started: the same command starts it"
    if _RUN_DIR.get("ray") == run_dir:
        return (f"{run_dir} keeps the rounds done; --runtime ray does not resume, the same "
                "command with another --out starts the run again")
    return f"the last checkpoint is intact (continue with edgepfl run --resume {run_dir})"


def _progress_flag(quiet: bool) -> bool | None:
    return False if quiet else None


PLUGIN_HELP = ("a plug-in to load: the path of a .py file or an importable module that "
               "registers algorithms, models or data sets (edgepfl.plugins); repeatable, and "
               "recorded in the run's config.json")


def _plugin_option(fn):
    return click.option("--plugin", "plugins", multiple=True, metavar="MODULE_OR_FILE",
                        help=PLUGIN_HELP)(fn)


def _with_plugins(cfg, plugins: tuple[str, ...]):
    """``cfg`` with the --plugin specs added to its ``plugins``, and every plug-in it names
    loaded, so that a command can check the names they register (``--algorithms``)."""
    from edgepfl.plugins import load_plugins, recorded

    # a file named in a configuration or by --set is recorded by its absolute path too,
    # so that a resume from another folder finds that file and no other of its name
    merged = recorded([*cfg.plugins, *plugins])
    load_plugins(merged)
    # a copy, not a configuration rebuilt from model_dump(): which settings the user gave
    # (model_fields_set: tune's check of algorithm.name) stays as it was
    return cfg if merged == cfg.plugins else cfg.model_copy(update={"plugins": merged})


def _counted(cfg):
    """``cfg`` with a natural split's count of clients from the data when not given: the
    runs of compare, sweep and tune are built from its dump, where every setting counts as
    given (``engine.parts.natural_clients``)."""
    from edgepfl.engine.parts import natural_clients

    return natural_clients(cfg)[0]


class _Threads(click.ParamType):
    name = "N|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            self.fail(f"{value!r}: give a number of threads >= 1, or auto", param, ctx)
        return number


def _threads(overrides: tuple[str, ...], value: int | str | None) -> tuple[str, ...]:
    """``--threads`` is ``--set train.threads=...`` for every run of the command."""
    return overrides if value is None else (*overrides, f"train.threads={value}")


def _job_threads(value: int | str | None) -> int | None:
    """The torch threads of each worker process of a command running jobs at once."""
    return value if isinstance(value, int) else None


THREADS_HELP = ("torch CPU threads, the setting train.threads (default auto: 1 for small "
                "models, else the cores no other process keeps busy)")


def _print_summary(summary: dict, out: Path | None) -> None:
    def pct(v):
        return "-" if v is None else f"{100 * v:.2f}%"
    best = (f"round {summary['best_round']}" if summary['best_round'] is not None else
            "no round scored a test sample: no client holds one")
    click.echo(
        f"{summary['algorithm']} on {summary['dataset']} ({summary['clients']} clients, "
        f"{summary['rounds']} rounds): best mean acc {pct(summary['acc_mean_best'])} "
        f"({best}), final {pct(summary['acc_mean_final'])} "
        f"± {pct(summary['acc_std_final'])} across clients, worst client "
        f"{pct(summary['acc_min_final'])}; {summary['bytes_up_total'] / 1e6:.2f} MB up, "
        f"{summary['bytes_down_total'] / 1e6:.2f} MB down, {summary['wall_time_s']:.1f} s")
    if summary.get("clients_diverged_final"):
        click.echo(f"  {summary['clients_diverged_final']} client(s) ended with a model whose "
                   "test loss is not finite (its training diverged): counted in the accuracy, "
                   "left out of the loss")
    if summary.get("stopped_early"):
        # the reason was logged when the run stopped: said once, not again here
        click.echo(f"  stopped early after round {summary['stopped_round']} of "
                   f"{summary['rounds_planned']} (why: logged above, and summary.json's "
                   "stop_reason)")
    if summary.get("edges"):
        click.echo(
            f"  {summary['edges']} edges, {summary['edge_rounds']} edge rounds per cloud round: "
            f"client <-> edge {summary['bytes_up_client_total'] / 1e6:.2f} MB up, "
            f"{summary['bytes_down_client_total'] / 1e6:.2f} MB down; edge <-> cloud "
            f"{summary['bytes_up_edge_total'] / 1e6:.2f} MB up, "
            f"{summary['bytes_down_edge_total'] / 1e6:.2f} MB down")
    if out is not None:
        click.echo(f"run directory: {out}")


IN_PROCESS = {"runtime": "simulation", "ray_address": None, "client_cpus": None,
              "client_gpus": None}


def _runtime_options(fn):
    """``edgepfl run``'s runtime: the in-process simulation, or edgepfl's Flower apps on
    Flower's simulation runtime over Ray (docs/cluster.md)."""
    for option in reversed([
        click.option("--runtime", type=click.Choice(["simulation", "ray"]), default="simulation",
                     show_default=True, help="simulation: edgepfl's in-process engine; ray: "
                     "edgepfl's Flower apps on Flower's simulation runtime, one Ray actor per "
                     "client call, on a local Ray or the cluster at --ray-address "
                     "(pip install 'edgepfl[cluster]'; docs/cluster.md)"),
        click.option("--ray-address", metavar="ADDRESS", help="with --runtime ray: the Ray "
                     "cluster to run on (HEAD_IP:6379, or auto: the one started on this "
                     "machine); default a new local Ray"),
        click.option("--client-cpus", type=click.FloatRange(min=0, min_open=True),
                     help="with --runtime ray: CPUs each client's actor asks for (default 1)"),
        click.option("--client-gpus", type=click.FloatRange(min=0),
                     help="with --runtime ray: GPUs (or a fraction) each client's actor asks "
                     "for (default 0; with --set train.device=cuda)")]):
        fn = option(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgepfl")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True,
              help="the package's log on standard error (warnings, a run stopping early, "
              "a Flower run resuming); per-round lines go where output is kept")
def main(log_level: str) -> None:
    """Personalized federated learning on heterogeneous edge devices.

    On a terminal a run shows a live line; with its output redirected (a file, a pipe, a
    batch job) it writes one line per evaluated round instead."""
    from edgepfl.engine.progress import configure_logging

    configure_logging(log_level)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a setting, e.g. --set train.rounds=10 (repeatable)")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="run directory (default runs/<algorithm>-<dataset>-<time>)")
@click.option("--resume", type=click.Path(path_type=Path),
              help="continue the run in this directory from its last checkpoint; with "
              "--set train.rounds=N (more than it has) extend a finished run")
@click.option("--quiet", is_flag=True, help="no progress display")
@click.option("--threads", type=_Threads(), help=THREADS_HELP)
@_plugin_option
@click.option("--trust-plugins", is_flag=True,
              help="with --resume: import the plug-ins the run's config.json names (code "
              "from the run directory; without it, those not given with --plugin are refused)")
@_runtime_options
@_user_errors(lambda: _how_to_resume(_RUN_DIR.get("dir")))
def run(config: Path | None, overrides: tuple[str, ...], out: Path | None,
        resume: Path | None, quiet: bool, threads: int | str | None,
        plugins: tuple[str, ...], trust_plugins: bool, **runtime) -> None:
    """Run one algorithm. With no arguments: FedAvg on digits, 10 clients, Dirichlet 0.3."""
    from edgepfl.config import config_from_sources, listed, load_config_file
    from edgepfl.engine.simulation import resume_run, start_run
    from edgepfl.io import read_json

    overrides = _threads(overrides, threads)
    _RUN_DIR.pop("dir", None)
    if runtime != IN_PROCESS:
        return _run_on_ray(config, overrides, out, resume, trust_plugins, quiet, plugins, **runtime)
    if resume is not None:
        _RUN_DIR["dir"] = resume
        if not resume.is_dir():
            raise EdgepflError(f"--resume {resume}: no such run directory"
                               + (" (it is a file)" if resume.exists() else ""))
        if out is not None and out != resume:
            raise EdgepflError("--out and --resume name different directories; a resume "
                               "continues in its own run directory")
        if plugins:  # the run's own plug-ins and these
            import json

            from edgepfl.plugins import recorded
            stored = read_json(resume / "config.json") if (resume / "config.json").exists() else {}
            known = stored.get("plugins", []) if isinstance(stored, dict) else []
            overrides = (*overrides, "plugins=" + json.dumps(recorded([*known, *plugins])))
        # --set alone applies to the run's own configuration (e.g. train.rounds=90 extends
        # it); a config file is a whole configuration that must match the run, and extends
        # it only if it, or --set, names train.rounds (not through the default)
        cfg = None
        if config:
            extra = list(overrides)
            if not _names_rounds(load_config_file(config), overrides):
                stored = read_json(resume / "config.json")
                train = stored.get("train") if isinstance(stored, dict) else None
                rounds = train.get("rounds") if isinstance(train, dict) else None
                if isinstance(rounds, int):
                    extra.insert(0, f"train.rounds={rounds}")
            cfg = config_from_sources(config, extra)
        # the plug-ins this command names (--plugin, the given file's) are the user's own;
        # those only the run's config.json names wait for --trust-plugins
        own = list(plugins)
        if config:
            named = listed(load_config_file(config).get("plugins"))
            own += named if isinstance(named, list) else []
        result = resume_run(resume, cfg, progress=_progress_flag(quiet),
                            overrides=None if config else list(overrides),
                            plugins=own, trust_plugins=trust_plugins)
    else:
        if trust_plugins:
            raise EdgepflError("--trust-plugins is for --resume: a new run loads the "
                               "plug-ins its command and configuration name")
        from edgepfl.engine.rundir import default_run_dir

        cfg = _with_plugins(config_from_sources(config, list(overrides)), plugins)
        out = out if out is not None else default_run_dir(cfg)
        _RUN_DIR["dir"] = out
        result = start_run(cfg, out, progress=_progress_flag(quiet))
    _print_summary(result.summary, result.out_dir)


def _run_on_ray(config: Path | None, overrides: tuple[str, ...], out: Path | None,
                resume: Path | None, trust_plugins: bool, quiet: bool,
                plugins: tuple[str, ...], runtime: str,
                ray_address: str | None, client_cpus: float | None,
                client_gpus: float | None) -> None:
    """``edgepfl run --runtime ray``: a new run into ``out`` (engine.flower_ray)."""
    from edgepfl.config import config_from_sources
    from edgepfl.engine.rundir import default_run_dir

    if runtime != "ray":
        raise EdgepflError("--ray-address, --client-cpus and --client-gpus are for "
                           "--runtime ray")
    if resume is not None or trust_plugins:
        raise EdgepflError("--resume and --trust-plugins are for the in-process runtime; "
                           "--runtime ray starts new runs")
    try:
        from edgepfl.engine.flower_ray import run_ray
    except ImportError as exc:  # flwr itself missing
        raise EdgepflError(f"--runtime ray needs Flower's simulation runtime: pip install "
                           f"'edgepfl[cluster]' ({exc})") from None
    from edgepfl.engine.trackers import flatten

    cfg = _with_plugins(config_from_sources(config, list(overrides)), plugins)
    out = out if out is not None else default_run_dir(cfg)
    _RUN_DIR["dir"] = _RUN_DIR["ray"] = out
    result = run_ray({**flatten(cfg.model_dump()), "out": str(out)}, ray_address,
                     client_cpus or 1.0, client_gpus or 0.0, _progress_flag(quiet))
    _print_summary(result.summary, result.out_dir)


def _names_rounds(data: dict, overrides: tuple[str, ...]) -> bool:
    train = data.get("train")
    return (isinstance(train, dict) and "rounds" in train) or any(
        o.partition("=")[0].strip() == "train.rounds" for o in overrides)


def _csv_list(value: str, kind: type, option: str) -> list:
    try:
        items = [kind(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise EdgepflError(f"{option} {value!r} must be a comma-separated list of {kind.__name__}s") from None
    if not items:
        raise EdgepflError(f"{option} is empty")
    repeated = sorted({str(v) for v in items if items.count(v) > 1})
    if repeated:
        raise EdgepflError(f"{option} names {', '.join(repeated)} more than once")
    return items


JOBS_HELP = ("runs at once, each in its own worker process with --threads torch threads "
             "(default: the cores shared out); results equal one-at-a-time runs")
RESUMABLE = ("the same command again continues: finished runs are kept, an interrupted one "
             "resumes from its checkpoint")


def _print_table(kind: str, out: Path) -> None:
    click.echo((out / f"{kind}.md").read_text())
    click.echo(f"written: {out}/{kind}.csv, {kind}.md, {kind}.png")


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--algorithms", required=True, help="comma-separated, e.g. local,fedavg,fedprox")
@click.option("--seeds", help="comma-separated seeds (default: the configuration's seed, 0)")
@click.option("--reference", metavar="NAME",
              help="the algorithm the others are paired with, seed by seed (default: fedavg "
              "if compared, else the first)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a setting")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="output directory (default runs/compare-<time>)")
@click.option("--jobs", type=int, default=1, show_default=True, help=JOBS_HELP)
@click.option("--tuned", "tuned", multiple=True, metavar="STUDY",
              type=click.Path(path_type=Path),
              help="a study of edgepfl tune (its folder, study.db or best.json): its algorithm "
              "runs with the study's best setting, the others at their defaults, and the "
              "table says which (repeatable, one study per algorithm)")
@click.option("--quiet", is_flag=True, help="no progress display")
@click.option("--threads", type=_Threads(), help=THREADS_HELP)
@_plugin_option
@_user_errors(RESUMABLE)
def compare(config: Path | None, algorithms: str, seeds: str | None, reference: str | None,
            overrides: tuple[str, ...], out: Path | None, jobs: int, tuned: tuple[Path, ...],
            quiet: bool, threads: int | str | None, plugins: tuple[str, ...]) -> None:
    """Compare algorithms on the same partition and client sequence, over seeds: mean,
    sample std and 95% t-interval per algorithm, and each one's paired difference to the
    reference."""
    from datetime import datetime

    overrides = _threads(overrides, threads)
    from edgepfl.algorithms import get_algorithm
    from edgepfl.config import config_from_sources
    from edgepfl.experiments.compare import compare as run_compare

    cfg = _counted(_with_plugins(config_from_sources(config, list(overrides)), plugins))
    names = _csv_list(algorithms, str, "--algorithms")
    for name in names:
        get_algorithm(name)
    seed_list = _csv_list(seeds, int, "--seeds") if seeds is not None else [cfg.seed]
    settings = notes = None
    if tuned:
        from edgepfl.experiments.compare_tuned import tuned_settings

        settings, notes = tuned_settings(tuned, names, cfg, echo=click.echo)
    out = out or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_compare(cfg, names, seed_list, out, progress=_progress_flag(quiet), echo=click.echo,
                jobs=jobs, threads=_job_threads(threads), reference=reference,
                settings=settings,
                tuned=notes)
    _print_table("comparison", out)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--grid", "grid", multiple=True, metavar="KEY=V1,V2,...",
              help="a setting and its values, read as TOML like --set's, e.g. "
              "--grid train.lr=0.01,0.05 (repeatable: every combination runs)")
@click.option("--seeds", help="comma-separated seeds (default: the configuration's seed, 0)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="a setting fixed for every run")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="output directory (default runs/sweep-<time>)")
@click.option("--jobs", type=int, default=1, show_default=True, help=JOBS_HELP)
@click.option("--quiet", is_flag=True, help="no progress display")
@click.option("--threads", type=_Threads(), help=THREADS_HELP)
@_plugin_option
@_user_errors(RESUMABLE)
def sweep(config: Path | None, grid: tuple[str, ...], seeds: str | None,
          overrides: tuple[str, ...], out: Path | None, jobs: int, quiet: bool,
          threads: int | str | None, plugins: tuple[str, ...]) -> None:
    """Run every combination of settings over seeds: one run directory each, and a table of
    best and final accuracy (mean, sample std, 95% t-interval over seeds) per combination.

    \b
    edgepfl sweep --grid train.lr=0.01,0.05 --grid partition.alpha=0.1,0.5 --seeds 0,1
    """
    from datetime import datetime

    overrides = _threads(overrides, threads)
    from edgepfl.config import config_from_sources
    from edgepfl.experiments.sweep import parse_grid
    from edgepfl.experiments.sweep import sweep as run_sweep

    axes = parse_grid(grid, overrides)
    cfg = _counted(_with_plugins(config_from_sources(config, list(overrides)), plugins))
    seed_list = _csv_list(seeds, int, "--seeds") if seeds is not None else [cfg.seed]
    out = out or Path("runs") / f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_sweep(cfg, axes, seed_list, out, progress=_progress_flag(quiet), echo=click.echo,
              jobs=jobs, threads=_job_threads(threads))
    _print_table("sweep", out)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--algorithm", required=True, help="the algorithm to tune, e.g. fedprox")
@click.option("--trials", type=int, required=True,
              help="trials in the study in all: those already done count, so the same "
              "command again runs only the missing ones")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="a setting fixed for every trial; a searched setting given here is left "
              "out of the search (needs eval.validation, e.g. --set eval.validation=0.2)")
@click.option("--space", "space", multiple=True, metavar="KEY=KIND:...",
              help="search KEY over a range, replacing its default range: "
              "loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH or choice:A,B,...; e.g. "
              "--space algorithm.mu=loguniform:0.001:1 (repeatable)")
@click.option("--study", "study", type=click.Path(path_type=Path),
              help="the study's folder (or its study.db), which holds the trials' run "
              "directories; an existing study goes on (default runs/tune-<algorithm>: the same "
              "command again goes on)")
@click.option("--out", "out", type=click.Path(path_type=Path),
              help="the same as --study, as the other commands name their folder")
@click.option("--jobs", type=int, default=1, show_default=True,
              help="worker processes sharing the study, each running trials with --threads "
              "torch threads (default: the cores shared out); the command in several shells "
              "with the same --study works too")
@click.option("--seed", type=int, default=0, show_default=True,
              help="the sampler's seed (a run's own seed is the configuration's: --set seed=N)")
@click.option("--prune/--no-prune", default=True, show_default=True,
              help="stop a trial whose best validation accuracy so far is under the median of "
              "the earlier trials' at the same round")
@click.option("--quiet", is_flag=True, help="no progress display")
@click.option("--threads", type=_Threads(), help=THREADS_HELP)
@_plugin_option
@_user_errors("the study keeps every finished trial: the same command again goes on with it")
def tune(config: Path | None, algorithm: str, trials: int, overrides: tuple[str, ...],
         space: tuple[str, ...], study: Path | None, out: Path | None, jobs: int, seed: int,
         prune: bool, quiet: bool, threads: int | str | None, plugins: tuple[str, ...]) -> None:
    """Search an algorithm's hyperparameters on the validation split (Optuna, TPE): each
    trial a run scored by its best mean validation accuracy over the rounds; tune.md and
    tune.csv list the trials, best.json holds the best setting for compare --tuned.

    \b
    edgepfl tune --algorithm fedprox --trials 30 --set eval.validation=0.2 \\
        --study runs/tune-fedprox
    """
    if study is not None and out is not None and study != out:
        raise EdgepflError(f"--study {study} and --out {out} name the same thing, the "
                           "study's folder, differently: give one of them")
    study = study if study is not None else out
    overrides = _threads(overrides, threads)
    from edgepfl.algorithms import get_algorithm
    from edgepfl.config import config_from_sources
    from edgepfl.experiments.tune import study_location
    from edgepfl.experiments.tune import tune as run_tune

    cfg = _counted(_with_plugins(config_from_sources(config, list(overrides)), plugins))
    get_algorithm(algorithm)
    folder, _ = study_location(study, algorithm)
    fixed = [o.partition("=")[0].strip() for o in overrides]
    best = run_tune(cfg, algorithm, trials, folder if study is None else study, space=space,
                    fixed=fixed, seed=seed, jobs=jobs, threads=_job_threads(threads),
                    pruner="median" if prune else "none", progress=_progress_flag(quiet),
                    echo=click.echo)
    click.echo((folder / "tune.md").read_text())
    click.echo(f"written: {folder}/tune.csv, tune.md" + (", best.json" if best else ""))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="also write report.md and the plots into this directory")
@_user_errors("each file written so far is whole (files are written atomically)")
def report(run_dirs: tuple[Path, ...], out: Path | None) -> None:
    """Cost table across runs (time per round split into download, client, upload,
    server; MB; GFLOPs) and plots of accuracy against bytes and simulated time."""
    from edgepfl.io import write_bytes_atomic
    from edgepfl.report.tables import report_plots, report_table

    table = report_table(list(run_dirs))
    click.echo(table)
    if out is not None:
        write_bytes_atomic(out / "report.md", table.encode())
        for path in report_plots(list(run_dirs), out):
            click.echo(f"written: {path}")


@main.command(name="list")
@click.argument("pattern", required=False)
@_plugin_option
@_user_errors("")
def list_(pattern: str | None, plugins: tuple[str, ...]) -> None:
    """Algorithms, data sets, models, partition schemes and settings; with PATTERN only the
    lines whose name or description contain it (case-insensitive; * and ? as wildcards),
    e.g. `edgepfl list lr` or `edgepfl list 'algorithm.*'`."""
    import fnmatch

    from edgepfl.algorithms import ALGORITHMS
    from edgepfl.config import describe_sections
    from edgepfl.data import DATASETS, SCHEMES
    from edgepfl.models import MODELS
    from edgepfl.plugins import load_plugins, origin

    load_plugins(plugins)

    def from_plugin(kind: str, name: str) -> str:
        who = origin(kind, name)
        return f"  (plug-in {who})" if who else ""

    def matches(key: str, text: str) -> bool:
        if pattern is None:
            return True
        line = f"{key} {text}".lower()
        wanted = pattern.lower()
        if any(c in wanted for c in "*?["):
            return fnmatch.fnmatch(key.lower(), wanted) or fnmatch.fnmatch(line, f"*{wanted}*")
        return wanted in line

    shown = 0

    def section(title: str, items: dict[str, str], whole: bool = False) -> None:
        nonlocal shown
        items = items if whole else {k: v for k, v in items.items() if matches(k, v)}
        if not items:
            return
        shown += len(items)
        click.echo(click.style(title, bold=True))
        width = max(len(k) for k in items)
        for k, v in items.items():
            click.echo(f"  {k:<{width}}  {v}")
        click.echo()

    def marks(a) -> str:
        tags = (["edges"] if a.edge is not None else []) + (["tiers"] if a.heterogeneous else [])
        return f"  [{', '.join(tags)}]" if tags else ""

    section("algorithms ([edges]: needs topology.edges; [tiers]: takes model.tiers)",
            {k: a.summary + marks(a) + from_plugin("algorithm", k) for k, a in ALGORITHMS.items()})
    section("datasets", {k: v + from_plugin("dataset", k) for k, v in DATASETS.items()})
    section("models", {k: v[1] + from_plugin("model", k) for k, v in MODELS.items()})
    section("partition schemes", SCHEMES)
    section("settings (--set KEY=VALUE)", {k: f"{d}  (default {v})" for k, v, d in describe_sections()})
    for name, algo in ALGORITHMS.items():
        rows = algo.describe()
        if rows:
            # `edgepfl list kapc` asks for KAPC's settings, whatever their descriptions say
            named = pattern is not None and fnmatch.fnmatch(name, pattern.lower())
            section(f"{name} hyperparameters",
                    {f"algorithm.{k}": f"{d}  (default {v})" for k, v, d in rows}, whole=named)
    if pattern is not None and not shown:
        raise click.ClickException(f"nothing listed matches {pattern!r}")


if __name__ == "__main__":
    main()
