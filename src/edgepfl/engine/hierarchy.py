"""The hierarchy's round (client -> edge -> cloud), the variant of ``Rounds.play`` for a
federation with edges: the cloud configures its edges, each edge runs ``edge_rounds``
(k2) edge rounds over its clients, reports, and the cloud aggregates. Messages between an
edge and the cloud are delivered here (copied, counted on the backhaul); on Flower the
edges are logical parts of the ServerApp process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgepfl.engine.ledger import EdgeBook
from edgepfl.engine.record import RoundRecord
from edgepfl.engine.schedule import async_edge_rounds
from edgepfl.engine.transport import check_keys
from edgepfl.federation.messages import Message

if TYPE_CHECKING:
    from edgepfl.engine.rounds import Rounds


def hierarchical_round(rounds: Rounds, record: RoundRecord) -> None:
    """The hierarchy's box: the cloud configures its edges, each edge runs its edge
    rounds over its clients, reports, and the cloud aggregates. ``book`` keeps the
    accounts beside it (``EdgeBook``)."""
    fed, rnd = rounds.federation, record.round
    k2, edges = fed.edge_rounds, range(fed.edges)
    # synchronous: every edge k2 edge rounds; asynchronous: as many as its speed allows
    plan = (async_edge_rounds(rounds.ledger.edge_times, k2, rounds.ledger.edge_debt)
            if rounds.asynchronous else [k2] * fed.edges)
    active = [k for k in edges if plan[k] > 0]
    # a busy edge's clients do not take part this period
    selected = record.selected = [c for c in record.selected if plan[fed.parent[c]] > 0]
    by_edge = {k: [c for c in selected if fed.parent[c] == k] for k in edges}
    book = record.book = EdgeBook(rounds.flops, rounds.counting, rounds.ledger, edges)
    with book.cloud():
        down_e = rounds.server.configure(rnd, active)
    check_keys(down_e, active, f"round {rnd}", "edges")
    book.sent_to_edges(down_e)
    for k in active:  # an edge still busy with its last period takes no new model
        with book.edge(k):
            rounds.edges[k].receive(rnd, down_e[k].delivered())
    for s in range(1, max(plan, default=0) + 1):
        working = [k for k in active if plan[k] >= s]
        down: dict[int, Message] = {}
        for k in working:
            with book.edge(k):
                msgs = rounds.edges[k].configure(rnd, s, by_edge[k])
            check_keys(msgs, by_edge[k], f"round {rnd}, edge {k}, edge round {s}", "clients")
            down.update(msgs)
        # the client step seeds the clients' work: the same in both schedules up to k2
        step = (rnd - 1) * k2 + s if s <= k2 else ("async", rnd, s)
        clients = sorted(c for k in working for c in by_edge[k])
        delivery = rounds.train(record, step, {c: down[c] for c in clients})
        book.delivered(delivery)
        for k in working:
            with book.edge(k):
                # an edge none of whose clients replied stays as it was
                if any(c in delivery.arrived for c in by_edge[k]):
                    rounds.edges[k].aggregate(rnd, s, rounds.aggregated(
                        step, k, down, delivery, by_edge[k]))
            book.edge_step(k, by_edge[k], down, delivery)
    up_e: dict[int, Message] = {}
    for k in edges:  # every edge reports what it holds; a busy one, its last model
        with book.edge(k):
            report = rounds.edges[k].report(rnd)
        # a busy edge's model is the one it last uploaded: the cloud holds it already
        book.reported(k, report, sent=plan[k] > 0)
        up_e[k] = report.delivered()
    with book.cloud():
        if book.replied:  # a round nobody replied in leaves the cloud as it was
            rounds.server.aggregate(rnd, up_e)
    book.close()
    record.traffic = book.row(rnd, len(selected))
    if rounds.asynchronous:
        record.plan = plan
        record.traffic.update(edge_rounds_min=min(plan), edge_rounds_max=max(plan),
                              edges_busy=fed.edges - len(active))
