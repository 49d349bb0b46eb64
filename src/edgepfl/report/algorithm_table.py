"""docs/algorithms.md's table of what each algorithm supports, and the README's list of
algorithm names, written from the registry.

What an algorithm takes (clients of several architectures, edge servers, differential
privacy at each level, batched clients, new clients) is declared once, in its file's
``ALGORITHM``; a table or list typed by hand beside it drifts. So each lives between two
markers (docs/algorithms.md, README.md) and is written by this module::

    python -m edgepfl.report.algorithm_table          # rewrite the table in place
    python -m edgepfl.report.algorithm_table --check  # exit 1 if it differs

and tests/test_docs_tables.py fails when the file and the registry disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgepfl.algorithms import ALGORITHMS
from edgepfl.contract.algorithm import Algorithm
from edgepfl.registered import origin

BEGIN = "<!-- supports table: written by python -m edgepfl.report.algorithm_table -->"
END = "<!-- end of supports table -->"
DOC = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"
NAMES_BEGIN = "<!-- algorithm names: written by python -m edgepfl.report.algorithm_table -->"
NAMES_END = "<!-- end of algorithm names -->"
README = DOC.parents[1] / "README.md"


def _row(algo: Algorithm) -> str:
    def mark(ok: bool) -> str:
        return "yes" if ok else "-"

    privacy = algo.privacy
    return (f"| `{algo.name}` | {algo.paper or '-'} | {mark(algo.heterogeneous)} | "
            f"{mark(algo.edge is not None)} | {mark(privacy.client == 'mean')} | "
            f"{mark(privacy.sample)} | {mark(algo.client.batchable)} | "
            f"{mark(not algo.no_new_clients)} |")


def _shipped() -> dict[str, Algorithm]:
    """The algorithms edgepfl ships (not a plug-in's), in the registry's order."""
    return {n: a for n, a in ALGORITHMS.items() if origin("algorithm", n) is None}


def name_list(algorithms: dict[str, Algorithm] | None = None) -> str:
    """The README's list: every name in the registry's order, star methods first, then
    those through edge servers."""
    algos = _shipped() if algorithms is None else algorithms
    star = [f"`{n}`" for n, a in algos.items() if a.edge is None]
    edge = [f"`{n}`" for n, a in algos.items() if a.edge is not None]
    return (f"{len(algos)} algorithms: {', '.join(star)}; through edge servers: "
            f"{', '.join(edge)}.")


def supports_table(algorithms: dict[str, Algorithm] | None = None) -> str:
    """The table, one row per algorithm edgepfl ships (not a plug-in's) in name order."""
    algos = _shipped() if algorithms is None else algorithms
    head = ["| name | paper | several architectures (`model.tiers`) | edges "
            "(`topology.edges`) | DP, client level | DP, sample level | batched clients "
            "(`train.batch_clients`) | new clients (`eval.new_clients`) |",
            "|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + [_row(algos[name]) for name in sorted(algos)])


def with_table(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    if begin not in text or end not in text:
        raise ValueError(f"the text lacks the markers {begin!r} and {end!r}")
    before, rest = text.split(begin, 1)
    _, after = rest.split(end, 1)
    return f"{before}{begin}\n{table}\n{end}{after}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write docs/algorithms.md's supports table and "
                                             "README.md's list of algorithm names")
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    args = ap.parse_args(argv)
    drifted = 0
    for path, begin, end, block in ((DOC, BEGIN, END, supports_table()),
                                    (README, NAMES_BEGIN, NAMES_END, name_list())):
        text = path.read_text()
        new = with_table(text, block, begin, end)
        if new == text:
            continue
        if args.check:
            print(f"{path}: written from the registry, it differs; run "
                  "python -m edgepfl.report.algorithm_table", file=sys.stderr)
            drifted = 1
        else:
            path.write_text(new)
    return drifted


if __name__ == "__main__":
    sys.exit(main())
