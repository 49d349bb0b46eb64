"""The round loop's side of privacy (``engine.rounds`` calls these and nothing else):
the replies an aggregation may see, what each round spends, where the budget stops a run.

* ``replies``: client level, each aggregation's replies become DP-FedAvg's clipped and
  noised ones (``dp_fedavg.private_replies``); otherwise the replies themselves.
* ``trained``: sample level, the DP-SGD steps each client reports, kept in the ledger (so
  a checkpoint keeps them and a resumed run goes on counting).
* ``row``: the round's ``epsilon`` (client level: the run's; sample level: the largest
  client's), for metrics.csv; ``summary``: the run's, with each client's at sample level.
* ``stop``: with ``privacy.target_epsilon``, the run stops after round r when round r + 1
  would pass the budget; known before round r + 1 runs (client level: epsilon is a function
  of the round; sample level: of each client's steps so far, the next round's seeded
  sample and the steps its clients will run). A budget that round 1 alone passes is
  refused at set-up.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from edgepfl.config import Config
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from edgepfl.federation.rng import generator, select_clients
from edgepfl.federation.topology import CLOUD, Federation
from edgepfl.privacy.accountant import client_epsilon, groups_of, library, sample_epsilon
from edgepfl.privacy.adaptive import AdaptiveClip
from edgepfl.privacy.dp_fedavg import Clipped, PrivacyError, private_replies
from edgepfl.privacy.dpsgd import RATE, STEPS, poisson_plan
from edgepfl.privacy.secure_sum import threshold

log = logging.getLogger("edgepfl")

SAMPLING = ("fixed-size sampling without replacement of each aggregator's clients every "
            "round (dp-accounting SampledWithoutReplacementDpEvent, replace-one, RDP)")
POISSON = ("Poisson sampling of each client's samples at every DP-SGD step (dp-accounting "
           "PoissonSampledDpEvent, {relation})")
RELATIONS = {"add_remove": "add-or-remove-one", "replace_one": "replace-one"}


class RoundPrivacy:
    """``privacy.level = "none"``: nothing changes."""

    level = "none"

    def replies(self, step: object, aggregator: int, sent: dict[int, Message],
                arrived: dict[int, Message], expected: int) -> dict[int, Message]:
        return arrived

    def trained(self, ledger: Any, delivery: Any) -> None:
        return None

    def row(self, ledger: Any, rnd: int) -> dict[str, float]:
        return {}

    def stop(self, ledger: Any, rounds_done: int) -> dict | None:
        return None

    def summary(self, ledger: Any, rounds_done: int) -> dict[str, Any]:
        return {}


class _Budgeted(RoundPrivacy):
    def __init__(self, cfg: Config, federation: Federation):
        library()
        self.cfg = cfg
        self.p = cfg.privacy
        # client level samples a fixed number of public clients: replace-one only
        self.relation = self.p.relation or ("replace_one" if self.p.level == "client"
                                            else "add_remove")
        self.federation = federation
        self._stops: dict[int, dict | None] = {}

    def epsilon(self, ledger: Any, rounds_done: int) -> float:
        raise NotImplementedError

    def predicted(self, ledger: Any, rounds_done: int) -> float:
        """Epsilon after round ``rounds_done`` + 1."""
        raise NotImplementedError

    def stop(self, ledger: Any, rounds_done: int) -> dict | None:
        target = self.p.target_epsilon
        if target is None or rounds_done >= self.cfg.train.rounds:
            return None
        if rounds_done not in self._stops:
            after = self.predicted(ledger, rounds_done)
            stop = None
            if after > target:
                stop = {"round": rounds_done, "epsilon_next": after, "reason": (
                    f"the privacy budget: round {rounds_done + 1} would spend epsilon "
                    f"{after:.4g} > privacy.target_epsilon = {target:g} (epsilon after round "
                    f"{rounds_done}: {self.epsilon(ledger, rounds_done):.4g}, delta "
                    f"{self.delta_text()})")}
                log.warning("privacy: the run stops after round %d of train.rounds = %d: %s",
                            rounds_done, self.cfg.train.rounds, stop["reason"])
            self._stops[rounds_done] = stop
        return self._stops[rounds_done]

    def check_budget(self, ledger: Any) -> None:
        """Refuse a budget that round 1 alone passes: the run would have nothing to run."""
        target = self.p.target_epsilon
        if target is None:
            return
        first = self.predicted(ledger, 0)
        if first > target:
            raise ConfigError(
                f"privacy.target_epsilon = {target:g}: round 1 alone spends epsilon {first:.4g} "
                f"(privacy.noise_multiplier = {self.p.noise_multiplier:g}, delta "
                f"{self.delta_text()}); raise privacy.noise_multiplier or the budget")

    def delta_text(self) -> str:
        raise NotImplementedError

    def details(self) -> dict[str, Any]:
        p = self.p
        return {"level": p.level, "noise_multiplier": p.noise_multiplier, "clip": p.clip,
                "accountant": p.accountant, "relation": self.relation,
                "target_epsilon": p.target_epsilon}


class ClientPrivacy(_Budgeted):
    """Client level: DP-FedAvg at the server, or at each edge (``privacy.noise_at``)."""

    level = "client"

    def __init__(self, cfg: Config, federation: Federation):
        super().__init__(cfg, federation)
        fed, share = federation, cfg.train.participation
        if fed.hierarchical:
            sizes = [len(fed.members(k)) for k in range(fed.edges)]
        else:
            sizes = [fed.num_clients]
        # how many clients an aggregator samples: the count ``select`` draws
        sampled = [len(select_clients(0, 1, n, share)) for n in sizes]
        self.groups = groups_of(list(zip(sizes, sampled, strict=True)))
        self.delta = self.p.delta if self.p.delta is not None else 1.0 / fed.num_clients
        self.counts = Clipped()
        self.adaptive = (AdaptiveClip(self.p, federation, sampled)
                         if self.p.clip == "adaptive" else None)
        if self.delta >= 1.0 / fed.num_clients:
            log.warning("privacy: delta %g (%s) is at least 1 / %d clients: a mechanism that "
                        "publishes one client's data whole meets such a guarantee; set "
                        "privacy.delta well under 1 / clients (e.g. %.2g) for a meaningful "
                        "epsilon", self.delta,
                        "privacy.delta" if self.p.delta is not None else "the default, 1 / clients",
                        fed.num_clients, 0.1 / fed.num_clients)
        self.check_budget(None)
        log.info("privacy: client level, %s; epsilon after train.rounds = %d: %.4g (delta %g)",
                 SAMPLING, cfg.train.rounds, self.epsilon(None, cfg.train.rounds), self.delta)

    def epsilon(self, ledger: Any, rounds_done: int) -> float:
        return client_epsilon(self.groups, self.p.noise_multiplier,
                              self.federation.edge_rounds, rounds_done, self.delta)

    def predicted(self, ledger: Any, rounds_done: int) -> float:
        return self.epsilon(ledger, rounds_done + 1)

    def delta_text(self) -> str:
        return f"{self.delta:g}"

    def replies(self, step: object, aggregator: int, sent: dict[int, Message],
                arrived: dict[int, Message], expected: int) -> dict[int, Message]:
        where = "the server" if aggregator == CLOUD else f"edge {aggregator}"
        gen = generator(self.cfg.seed, "privacy", step, aggregator)
        adaptive = self.adaptive
        if adaptive is None:
            assert not isinstance(self.p.clip, str)
            sigma = self.p.noise_multiplier
            if self.p.secure_aggregation:
                # the deployment's noise: each client adds what a sum of the SecAgg+
                # threshold t needs, so m >= t replies carry sqrt(m / t) times sigma
                # (secure_sum); below t a deployment's sum does not unmask
                t = threshold(expected, self.p.secagg_threshold)
                sigma *= math.sqrt(max(len(arrived), t) / t)
            return private_replies(arrived, sent, expected, self.p.clip, sigma, gen,
                                   f"client step {step}, {where}", self.counts)
        counts = Clipped()
        out = private_replies(arrived, sent, expected, adaptive.clip(aggregator),
                              adaptive.noise_multiplier(aggregator), gen,
                              f"client step {step}, {where}", counts)
        if counts.replies:
            adaptive.update(aggregator, counts.replies, counts.replies - counts.clipped,
                            generator(self.cfg.seed, "privacy-clip", step, aggregator))
        self.counts.replies += counts.replies
        self.counts.clipped += counts.clipped
        return out

    def trained(self, ledger: Any, delivery: Any) -> None:
        if self.adaptive is not None:  # the clips live in the ledger the run goes on with
            self.adaptive.bind(ledger)

    def row(self, ledger: Any, rnd: int) -> dict[str, float]:
        counts, self.counts = self.counts, Clipped()
        return {"epsilon": self.epsilon(ledger, rnd),
                "dp_clipped": counts.clipped / counts.replies if counts.replies else math.nan,
                **(self.adaptive.row() if self.adaptive is not None else {})}

    def summary(self, ledger: Any, rounds_done: int) -> dict[str, Any]:
        return {"epsilon": self.epsilon(ledger, rounds_done), "delta": self.delta,
                "privacy": {**self.details(), "delta": self.delta, "sampling": SAMPLING,
                            "aggregators": [{"clients": n, "sampled": k}
                                            for n, k in self.groups],
                            "noise_at": ("edge" if self.federation.hierarchical
                                         else "server"),
                            **(self._adaptive(ledger) if self.adaptive is not None else {})}}

    def _adaptive(self, ledger: Any) -> dict[str, Any]:
        a, p = self.adaptive, self.p
        assert a is not None
        return {"clip_final": a.final(ledger), "clip_initial": p.clip_initial,
                "target_quantile": p.target_quantile, "clip_lr": p.clip_lr,
                "clip_count_stddev": a.stddev if self.federation.hierarchical else a.stddev[0],
                "update_noise_multiplier": (a.multiplier if self.federation.hierarchical
                                            else a.multiplier[0])}


class SamplePrivacy(_Budgeted):
    """Sample level: each client's epsilon from the DP-SGD steps it reported."""

    level = "sample"

    def __init__(self, cfg: Config, federation: Federation, sizes: list[int] | None,
                 epochs: int):
        super().__init__(cfg, federation)
        self.sizes = sizes
        self.epochs = epochs
        if sizes is None and self.p.target_epsilon is not None:
            raise ConfigError(
                "privacy.target_epsilon at privacy.level = 'sample' needs each client's number "
                "of samples before it trains (to know what its next round spends), which this "
                "runtime's server does not have; run it in the simulation, or leave "
                "privacy.target_epsilon unset (epsilon is still reported)")
        if cfg.topology.mode != "sync" and self.p.target_epsilon is not None:
            raise ConfigError(
                "privacy.target_epsilon at privacy.level = 'sample' with topology.mode = "
                f"{cfg.topology.mode!r}: a client's edge then runs as many edge rounds as "
                "simulated speeds allow, so what its next round spends is not known before it "
                "runs; set topology.mode = 'sync', or leave privacy.target_epsilon unset")
        self.check_budget(None)
        log.info("privacy: sample level (DP-SGD), %s",
                 POISSON.format(relation=RELATIONS[self.relation]))

    # -- each client's record: [rate, steps] pairs in the ledger -------------------------
    @staticmethod
    def record(ledger: Any) -> dict[str, list]:
        if ledger is None:
            return {}
        if not ledger.privacy:
            n = ledger.num_clients
            ledger.privacy.update({"events": [[] for _ in range(n)], "size": [0] * n})
        return ledger.privacy

    def _delta(self, size: int) -> float:
        if self.p.delta is not None:
            return self.p.delta
        return 1.0 / size if size > 0 else 1.0

    def delta_text(self) -> str:
        return f"{self.p.delta:g}" if self.p.delta is not None else "1 / each client's samples"

    def _epsilon(self, events: list[list[float]], size: int) -> float:
        key = tuple((float(r), int(s)) for r, s in events)
        return sample_epsilon(key, self.p.noise_multiplier, self._delta(size), self.p.accountant,
                              self.relation)

    def _add(self, events: list[list[float]], rate: float, steps: int) -> list[list[float]]:
        out = [list(e) for e in events]
        for e in out:
            if e[0] == rate:
                e[1] += steps
                return out
        return [*out, [rate, steps]]

    def _plan(self, cid: int) -> tuple[float, int]:
        assert self.sizes is not None
        return poisson_plan(self.sizes[cid], self.cfg.train.batch_size, self.epochs)

    def trained(self, ledger: Any, delivery: Any) -> None:
        rec = self.record(ledger)
        for cid, reply in delivery.replies.items():
            if STEPS not in reply.stats or RATE not in reply.stats:
                raise PrivacyError(
                    f"privacy.level = 'sample': client {cid}'s reply does not report the DP-SGD "
                    "steps it ran, so its privacy cannot be accounted; every client must run "
                    "edgepfl's client step with the same privacy settings")
            steps, rate = int(reply.stats[STEPS]), float(reply.stats[RATE])
            if self.sizes is not None and steps > self._plan(cid)[1]:
                raise PrivacyError(
                    f"privacy.level = 'sample': client {cid} ran {steps} DP-SGD steps in one "
                    f"update, more than the {self._plan(cid)[1]} its algorithm declares "
                    "(PrivacySupport.epochs); the budget's forecast would be wrong")
            rec["size"][cid] = int(reply.num_samples)
            if steps:
                rec["events"][cid] = self._add(rec["events"][cid], rate, steps)
        for cid in delivery.lost:  # it may have trained: count what it would have run
            if self.sizes is None:
                raise PrivacyError(
                    f"privacy.level = 'sample': client {cid}'s reply was lost, so the DP-SGD "
                    "steps it may have run are unknown; the run stops rather than "
                    "under-count them")
            rate, steps = self._plan(cid)
            rec["size"][cid] = self.sizes[cid]
            rec["events"][cid] = self._add(rec["events"][cid], rate, steps)

    def epsilons(self, ledger: Any) -> list[float]:
        rec = self.record(ledger)
        if not rec:
            return [0.0] * self.federation.num_clients
        return [self._epsilon(ev, size) for ev, size in zip(rec["events"], rec["size"],
                                                            strict=True)]

    def epsilon(self, ledger: Any, rounds_done: int) -> float:
        return max(self.epsilons(ledger), default=0.0)

    def predicted(self, ledger: Any, rounds_done: int) -> float:
        assert self.sizes is not None
        rec = self.record(ledger)
        fed = self.federation
        chosen = fed.select(self.cfg.seed, rounds_done + 1, self.cfg.train.participation)
        worst = self.epsilon(ledger, rounds_done) if rec else 0.0
        for cid in chosen:
            rate, steps = self._plan(cid)
            events = rec["events"][cid] if rec else []
            ahead = self._add(events, rate, steps * fed.edge_rounds)
            worst = max(worst, self._epsilon(ahead, self.sizes[cid]))
        return worst

    def row(self, ledger: Any, rnd: int) -> dict[str, float]:
        return {"epsilon": self.epsilon(ledger, rnd)}

    def summary(self, ledger: Any, rounds_done: int) -> dict[str, Any]:
        eps = self.epsilons(ledger)
        sizes = self.record(ledger).get("size", [0] * len(eps))
        worst = max(range(len(eps)), key=lambda c: (eps[c], -c), default=None)
        # the headline epsilon is one client's: the pair names that client's delta (each
        # client's own, 1 / its samples, when privacy.delta is unset)
        delta = (self.p.delta if self.p.delta is not None or worst is None
                 else self._delta(sizes[worst]))
        return {"epsilon": max(eps, default=0.0),
                "epsilon_per_client": eps,
                "delta": delta,
                "privacy": {**self.details(), "delta": self.p.delta,
                            "delta_per_client": [self._delta(n) for n in sizes],
                            "sampling": POISSON.format(relation=RELATIONS[self.relation]),
                            "steps_per_client": [sum(int(s) for _, s in ev)
                                                 for ev in self.record(ledger)["events"]]}}


def round_privacy(parts: Any, sizes: list[int] | None) -> RoundPrivacy:
    """The round loop's privacy for a run's ``parts`` (``engine.parts.Parts``); ``sizes``:
    each client's training samples where the runtime knows them before the clients report
    (the simulation), else None."""
    cfg = parts.cfg
    if cfg.privacy.level == "client":
        return ClientPrivacy(cfg, parts.federation)
    if cfg.privacy.level == "sample":
        declared = parts.algorithm.privacy.epochs
        epochs = cfg.train.local_epochs if declared is None else declared(cfg.train, parts.hp)
        return SamplePrivacy(cfg, parts.federation, sizes, epochs)
    from edgepfl.config import SECAGG, PrivacyConfig

    SECURE = ("secure_aggregation", *SECAGG)  # noqa: N806 - secure aggregation acts without DP

    default = PrivacyConfig().model_dump()
    unused = [f"privacy.{k}" for k, v in cfg.privacy.model_dump().items()
              if k not in ("level", *SECURE) and v != default.get(k)]
    if unused:
        log.warning("%s %s set but privacy.level = 'none': no noise is added and nothing is "
                    "accounted; set privacy.level = 'client' or 'sample' for them to act",
                    ", ".join(unused), "is" if len(unused) == 1 else "are")
    return RoundPrivacy()
