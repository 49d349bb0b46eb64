"""docs/algorithms.md's table of what each algorithm supports, written from the registry.

What an algorithm takes (clients of several architectures, edge servers, differential
privacy at each level, batched clients, new clients) is declared once, in its file's
``ALGORITHM``; a table typed by hand beside it drifts. So the table lives between two
markers in docs/algorithms.md and is written by this module::

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


def _row(algo: Algorithm) -> str:
    def mark(ok: bool) -> str:
        return "yes" if ok else "-"

    privacy = algo.privacy
    return (f"| `{algo.name}` | {algo.paper or '-'} | {mark(algo.heterogeneous)} | "
            f"{mark(algo.edge is not None)} | {mark(privacy.client == 'mean')} | "
            f"{mark(privacy.sample)} | {mark(algo.client.batchable)} | "
            f"{mark(not algo.no_new_clients)} |")


def supports_table(algorithms: dict[str, Algorithm] | None = None) -> str:
    """The table, one row per algorithm edgepfl ships (not a plug-in's) in name order."""
    algos = ({n: a for n, a in ALGORITHMS.items() if origin("algorithm", n) is None}
             if algorithms is None else algorithms)
    head = ["| name | paper | several architectures (`model.tiers`) | edges "
            "(`topology.edges`) | DP, client level | DP, sample level | batched clients "
            "(`train.batch_clients`) | new clients (`eval.new_clients`) |",
            "|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + [_row(algos[name]) for name in sorted(algos)])


def with_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC} lacks the markers {BEGIN!r} and {END!r}")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{table}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write docs/algorithms.md's supports table")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = with_table(text, supports_table())
    if args.check:
        if new != text:
            print(f"{DOC}: the supports table differs from the registry; run "
                  "python -m edgepfl.report.algorithm_table", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
