"""The algorithm contract: a server part and a client part that only exchange messages.

* ``Server.configure`` says what each selected client receives this round (its keys are
  the round's participants: the selection, or more where the protocol asks for more);
  ``Server.aggregate`` folds the replies into server state. What a server reports beside
  that (metrics columns, figures, files) it declares by inheriting ``Reporter``.
* ``Client.update`` trains one client, given the message and that client's persistent
  state, and returns the reply and the new state. One ``Client`` object serves every
  simulated client, so it must keep no per-client memory of its own: everything a
  client remembers between rounds lives in the ``state`` mapping, which the engine keeps
  stacked (and which on Flower lives with the real client).
* Evaluation: ``Server.eval_message`` is what a client would hold to predict with (the
  global model for FedAvg, nothing for methods whose personal model stays on the client);
  ``Client.personal_model`` turns that and the client's state into the model it predicts
  with. Evaluation traffic is a measurement, not protocol, so it is not counted.
* New clients (``eval.new_clients``): ``Server.new_client_message`` is what the server
  gives a client that never trained, ``Client.new_client_model`` what that client makes
  of it (by default: fine-tuned on its own data); an algorithm that has nothing to give a
  stranger says why in ``Algorithm.no_new_clients``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from edgepfl.config import TrainConfig
from edgepfl.federation.aggregate import ParamIndex
from edgepfl.federation.messages import Message, MessageError, check_entries
from edgepfl.federation.state import load_state, save_state
from edgepfl.federation.store import MEMORY, Stacks
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest
from edgepfl.training.trainer import Trainer

if TYPE_CHECKING:
    from collections.abc import Callable

    from edgepfl.federation.topology import Federation

State = dict[str, torch.Tensor]

MODEL_PREFIX = "model."


def model_to_state(model: State) -> State:
    """A client's personal model as entries of its persistent state (``model.<param>``)."""
    return {MODEL_PREFIX + k: v for k, v in model.items()}


def model_from_state(state: State) -> State:
    """The personal model stored by ``model_to_state`` (other state entries ignored)."""
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


class Hyperparameters(BaseModel):
    """Base of every algorithm's typed hyperparameters (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
    # settings added after runs were stored whose default is not what those runs did: the
    # value a stored configuration without the key ran with (``rundir.comparable``), so
    # that a kept run is never mistaken for one of today's default
    before: ClassVar[dict[str, Any]] = {}
    # the settings worth searching (``edgepfl tune``), by hyperparameter name: those the
    # method's paper tunes or shows it is sensitive to, over ranges whose every value the
    # fields' own checks accept, alone and in any combination; a ``train.<key>`` entry
    # replaces the common range of that setting for this method (``experiments.tune``)
    search_space: ClassVar[dict[str, SearchRange]] = {}
    # train.* settings of the common search space (``experiments.tune.TRAIN_SPACE``) that the
    # method never reads: a trial spent on them would only measure noise
    not_searched: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class LogUniform:
    """A float range searched on a log scale: ``0 < low < high``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (0 < self.low < self.high):
            raise ValueError(f"a log-uniform range needs 0 < LOW < HIGH, got LOW = {self.low!r}, "
                             f"HIGH = {self.high!r}")

    def ends(self) -> tuple[Any, ...]:
        return (self.low, self.high)


@dataclass(frozen=True)
class Uniform:
    """A float range searched on a linear scale: ``low < high``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not (self.low < self.high):
            raise ValueError(f"a uniform range needs LOW < HIGH, got LOW = {self.low!r}, "
                             f"HIGH = {self.high!r}")

    def ends(self) -> tuple[Any, ...]:
        return (self.low, self.high)


@dataclass(frozen=True)
class IntRange:
    """Whole numbers from ``low`` to ``high``, both included: ``low < high``."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high)):
            raise ValueError(f"an int range needs whole numbers, got LOW = {self.low!r}, "
                             f"HIGH = {self.high!r}")
        if not (self.low < self.high):
            raise ValueError(f"an int range needs LOW < HIGH, got LOW = {self.low!r}, "
                             f"HIGH = {self.high!r}")

    def ends(self) -> tuple[Any, ...]:
        return (self.low, self.high)


@dataclass(frozen=True)
class Choice:
    """One of a few values (numbers, strings, booleans), none twice, at least two."""

    options: tuple[Any, ...]

    def __post_init__(self) -> None:
        if len(self.options) < 2:
            raise ValueError(f"a choice needs at least two values, got {list(self.options)!r}")
        if len(set(map(repr, self.options))) < len(self.options):
            raise ValueError(f"a choice names a value twice: {list(self.options)!r}")
        bad = [v for v in self.options if not isinstance(v, bool | int | float | str)]
        if bad:
            raise ValueError(f"a choice holds numbers, strings or booleans, not {bad[0]!r}")

    def ends(self) -> tuple[Any, ...]:
        return self.options


SearchRange = LogUniform | Uniform | IntRange | Choice


@dataclass(frozen=True)
class Architecture:
    """One model architecture of a federation: its layers and seeded initial weights."""

    name: str
    layers: LayerSpec
    init_model: State


@dataclass
class ServerContext:
    """What a server (the cloud in a hierarchy) knows of its federation.

    ``layers`` / ``init_model`` are those of the federation's first architecture (its only
    one unless ``model.tiers`` gives clients different models); ``architectures`` has every
    one and ``federation.arch[cid]`` says which a client holds. ``fresh_model(seed)`` draws
    another initial model of that architecture, as ``init_model`` was drawn, from ``seed``
    (for a method that starts each client from its own). ``stacks`` allocates what the
    server keeps per client (``[num_clients, ...]`` tensors, ``StackedStore``s): on disk
    when the run says so (``train.store``).
    """

    num_clients: int
    layers: LayerSpec
    init_model: State
    train: TrainConfig
    seed: int
    federation: Federation | None = None
    architectures: dict[str, Architecture] = field(default_factory=dict)
    fresh_model: Callable[[int], State] | None = None
    input_shape: tuple[int, int, int] | None = None  # (C, H, W) of a whole image
    stacks: Stacks = MEMORY

    @property
    def arch_of(self) -> tuple[str, ...]:
        """Each client's architecture name."""
        if self.federation is None:
            return ("",) * self.num_clients
        return self.federation.arch

    def model_of(self, cid: int) -> State:
        """Client ``cid``'s initial model: the names, shapes and dtypes it holds."""
        arch = self.architectures.get(self.arch_of[cid])
        return self.init_model if arch is None else arch.init_model

    def init_models(self) -> dict[str, State]:
        """Architecture name -> its initial model."""
        if not self.architectures:
            return {"": self.init_model}
        return {name: a.init_model for name, a in self.architectures.items()}

    def param_index(self) -> ParamIndex | None:
        """Which parameters of the architectures are the same; None with one architecture
        (every client holds every parameter, and averaging is plain ``weighted_average``)."""
        if len(self.architectures) <= 1:
            return None
        return ParamIndex(self.init_models())


@dataclass
class EdgeContext(ServerContext):
    """An edge server's view: its id and the clients under it (``members``)."""

    edge: int = 0
    members: tuple[int, ...] = ()


@dataclass
class ClientContext:
    trainer: Trainer
    layers: LayerSpec
    train: TrainConfig
    num_classes: int
    seed: int
    arch: str = ""
    fresh_model: Callable[[int], State] | None = None  # as ServerContext's, for ``arch``


@dataclass
class UpdateResult:
    reply: Message
    state: State
    stats: dict[str, float] = field(default_factory=dict)


class Stateful:
    """A part whose resumable state is declared: ``state`` names the attributes that hold
    it (tensors, models as name -> tensor mappings, StackedStores, JSON values), and the
    runtime checkpoints them (``edgepfl.federation.state``)."""

    state: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> State:
        """The state's tensors (what the server's state bytes measure, every round)."""
        return save_state(self, self.state, tensors_only=True)[0]

    def save_state(self) -> tuple[State, dict[str, Any]]:
        return save_state(self, self.state)

    def load_state(self, tensors: State, meta: dict[str, Any] | None = None) -> None:
        load_state(self, self.state, tensors, meta or {})


class Server(Stateful, ABC):
    """The coordinating part: in a star it configures and aggregates clients; in a
    client -> edge -> cloud hierarchy it is the cloud and its peers are the edges (the
    keys of ``configure`` and ``aggregate`` are then edge ids)."""

    def __init__(self, ctx: ServerContext, hp: Any):
        self.ctx = ctx
        self.hp = hp

    @abstractmethod
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        """Each participant's message this round. ``selected`` is the engine's seeded sample
        (``train.participation``); the keys are the round's participants: every selected
        client, and in a star any other client that trains where the protocol needs it
        (HMPL times every client in its first round: ``ctx.federation.trained``)."""

    @abstractmethod
    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None: ...

    def eval_message(self, cid: int) -> Message | None:
        return None

    def new_client_message(self, cid: int) -> Message | None:
        """What the server gives client ``cid`` that never trained (``eval.new_clients``)
        to adapt from: by default its evaluation message (FedAvg's global model). A server
        whose evaluation message is per client (or none) but that holds a model for
        strangers (Ditto's global one) returns that. Not counted, as evaluation is not."""
        return self.eval_message(cid)

    def check_reply(self, cid: int, reply: Message) -> None:
        """Raise ``MessageError`` if client ``cid``'s reply is not what this algorithm's
        clients send; called for every reply before ``aggregate``, which then sees only
        replies that passed (the engine has already refused NaN/Inf and oversized ones).
        It changes nothing: a refused reply must leave the round as if it never came.
        The default (``check_model_entries``) takes FedAvg's reply: exactly the client's
        model (every parameter and buffer, of its shape and dtype, no other tensor) and a
        positive integer ``num_samples``; an algorithm whose clients send anything else
        (a subset, extra tensors) states its exact reply with ``check_message`` (every
        tensor's name, shape and dtype, every metadata value's form), so that
        ``aggregate`` need not."""
        check_model_entries(self.ctx, cid, reply)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # what a server reports it declares by inheriting Reporter; a reporting method on a
        # server that does not would never be called, and its figures would go missing
        stray = sorted(REPORTS & set(vars(cls)))
        if stray and not issubclass(cls, Reporter):
            raise TypeError(f"{cls.__name__} defines {', '.join(stray)} but does not inherit "
                            "edgepfl.contract.algorithm.Reporter, through which the engine "
                            "calls them: add Reporter to its bases")


class RoundView(Protocol):
    """What a ``Reporter`` may read of a round once its server (or edge) has aggregated:
    the engine's record of it (``engine.record.RoundRecord``)."""

    round: int
    selected: list[int]
    #: bytes that crossed each client's link as the engine counts them (``bytes_down``: the
    #: messages delivered, none to a dropped client; ``bytes_up``: the replies that reached
    #: the server, refused ones too); a star's clients only
    bytes_down: dict[int, int]
    bytes_up: dict[int, int]

    def timing(self) -> Timing | None:
        """Each client's round time (``Timing``): computed on first call, so only a
        reporter that adapts to its devices' speed (HMPL's tiers) pays for it; None in a
        hierarchy."""
        ...


@dataclass
class Timing:
    """The round time in seconds of each client that replied, late ones included (a late
    client's time is what made it late; refused replies are not timed): simulated by the
    system model in the simulation, its measured training time on Flower; ``compute``
    each one's training time alone (the simulation's compute time, without the links; on
    Flower the same measured time) and, where FLOPs are counted (``system.count_flops``,
    the simulation), each one's local-training ``flops`` (else None)."""

    times: dict[int, float]
    compute: dict[int, float]
    flops: dict[int, int] | None = None


class Reporter:
    """What a server (or edge) reports beside the protocol, as an observer of each round's
    record: inherit it beside ``Server`` and override what you report. The engine calls
    ``observe`` after every aggregation with the round's record, ``round_metrics`` for the
    round's metrics row, ``evaluation_metrics`` in an evaluated round, ``summary_figures``
    and ``write_artifacts`` when the run ends."""

    def observe(self, record: RoundView) -> None:
        """The round's record, after ``aggregate`` (what crossed each link, each client's
        time): for a method that adapts to it (HMPL ranks its tiers by the times) or
        reports its own split of it (HMPL's bytes per tier)."""
        return None

    def round_metrics(self) -> dict[str, float]:
        """Algorithm-specific per-round figures for metrics.csv (e.g. layers uploaded)."""
        return {}

    def evaluation_metrics(self, rnd: int, client_acc: list[float]) -> dict[str, float]:
        """Algorithm-specific figures of an evaluated round from each client's accuracy
        (NaN: a client not evaluated), for its metrics row (e.g. HMPL's mean per tier)."""
        return {}

    def summary_figures(self, metrics: list[dict]) -> dict[str, Any]:
        """Algorithm-specific figures for summary.json, from the run's metric rows (e.g.
        DC-PFL's mean over its last aggregation period)."""
        return {}

    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        """Algorithm-specific files for the run directory (e.g. a relation-matrix heatmap),
        written when the run ends; use ``edgepfl.io`` so writes are atomic."""
        return None


REPORTS = frozenset(n for n in vars(Reporter) if not n.startswith("_"))


class Edge(Stateful, ABC):
    """An edge server between its clients and the cloud (hierarchical algorithms).

    Per cloud round: ``receive`` what the cloud sent, then ``edge_rounds`` (k2) times
    ``configure`` its selected clients and ``aggregate`` their replies, then ``report``
    to the cloud. One object per edge; what it keeps between cloud rounds is declared
    ``state`` like a server's.
    """

    def __init__(self, ctx: EdgeContext, hp: Any):
        self.ctx = ctx
        self.hp = hp

    @abstractmethod
    def receive(self, rnd: int, msg: Message) -> None: ...

    @abstractmethod
    def configure(self, rnd: int, step: int, selected: list[int]) -> dict[int, Message]: ...

    @abstractmethod
    def aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None: ...

    @abstractmethod
    def report(self, rnd: int) -> Message: ...

    def eval_message(self, cid: int) -> Message | None:
        """What client ``cid`` predicts with, if the edge holds it (else the cloud's)."""
        return None

    def check_reply(self, cid: int, reply: Message) -> None:
        """As ``Server.check_reply``, for the replies of this edge's clients."""
        check_model_entries(self.ctx, cid, reply)


def check_model_entries(ctx: ServerContext, cid: int, reply: Message) -> None:
    """The default reply check: exactly client ``cid``'s model (every tensor of it, of its
    shape and dtype, and no other tensor) and a positive integer ``num_samples`` in the
    metadata (other metadata is the algorithm's own). A reply that fails is refused: a
    failed client, never an error in ``aggregate``."""
    who = f"client {cid}"
    check_entries(who, reply.tensors, ctx.model_of(cid), required=True, unknown=False)
    n = reply.meta.get("num_samples")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MessageError(f"{who} sent num_samples = {n!r}; expected a positive integer "
                           "(the samples it trained on)")


class Client(ABC):
    # Whether the engine may train this client together with others (train.batch_clients):
    # declared by a client whose ``update`` is ``run_update`` whenever its ``fit_request``
    # gives a request, so that training the request elsewhere and calling ``finish`` is
    # the update itself.
    batchable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a rewritten update need not be the fit_request and finish it inherits: batching
        # it would skip the rewrite, unless the subclass declares it batchable again
        if "update" in vars(cls) and "batchable" not in vars(cls):
            cls.batchable = False

    def __init__(self, ctx: ClientContext, hp: Any):
        self.ctx = ctx
        self.hp = hp
        self.trainer = ctx.trainer

    def init_state(self, cid: int, init_model: State) -> State:
        """State of a client before its first round (default: none)."""
        return {}

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        """Client ``cid``'s round: its reply to ``msg`` and its new state. The default is
        the plain fit, ``run_update``; a client whose round is more rewrites this."""
        return self.run_update(cid, msg, state, data, gen)

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest | None:
        """This update's local training as a ``FitRequest``, for a client whose ``update``
        is "start from some weights, ``fit``, reply from the weights it ends with" and says
        so by defining this and ``finish``. Declared ``batchable``, the engine may then
        train the client together with others (``train.batch_clients``). None (the
        default, or for this message): ``update`` runs whole."""
        return None

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        """The update's result from its ``fit_request``'s trained weights and stats."""
        raise NotImplementedError(f"{type(self).__name__} has a fit_request but no finish")

    def idle(self, cid: int, msg: Message, state: State) -> UpdateResult:
        """The update's result when its ``fit_request`` asks for no training (the default:
        a client that always trains has none)."""
        raise RuntimeError(f"{type(self).__name__} requested no training and "
                           "gave no idle result")

    def run_update(self, cid: int, msg: Message, state: State, data: ClientData,
                   gen: torch.Generator) -> UpdateResult:
        """The plain fit: the update's request trained on the client's trainer, then
        ``finish``; ``idle`` when it requests no training."""
        request = self.fit_request(cid, msg, state, data, gen)
        if request is None:
            return self.idle(cid, msg, state)
        trainer = request.trainer or self.trainer
        return self.finish(cid, msg, state, data, *trainer.run(request))

    @abstractmethod
    def personal_model(self, state: State, eval_msg: Message | None) -> State: ...

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        """The models the client predicts with, by name: ``""`` is its personalized
        prediction (what every algorithm reports as ``acc_*``); another name (``"global"``)
        adds ``acc_<name>_*`` figures. Several models make a Monte Carlo predictive: their
        class probabilities are averaged. ``data`` is the client's own training data, for a
        method whose protocol personalizes at test time (hierbayes' Eq. 33)."""
        return {"": [self.personal_model(state, eval_msg)]}

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """The models client ``cid``, which never trained (``eval.new_clients``), predicts
        with once served ``msg`` (``Server.new_client_message``): ``state`` is its initial
        state (``init_state``), ``data`` its training data, ``epochs`` the local epochs it
        may adapt for (``eval.new_client_epochs``), ``gen`` its batch generator. Default:
        its personalized prediction (``predictive``), one model fine-tuned for ``epochs``
        with the run's SGD settings (``fine_tuned``); a Monte Carlo predictive (several
        models: fitted at test time already) as it is. A method whose newcomer starts from
        another model, or adapts only a part of it, overrides this."""
        models = self.predictive(cid, state, msg, data)[""]
        if len(models) != 1:
            return models
        return [fine_tuned(self, models[0], data, epochs, gen)]


def fine_tuned(client: Client, start: State, data: ClientData, epochs: int,
               gen: torch.Generator, trainable: list[str] | None = None) -> State:
    """``start`` trained for ``epochs`` local epochs on ``data`` with the run's SGD settings
    (train.lr, batch_size, momentum, weight_decay), only the parameters ``trainable`` (all:
    None); 0 epochs: ``start`` itself."""
    if epochs == 0:
        return start
    t, trainer = client.ctx.train, client.trainer
    trainer.load(start)
    trainer.fit(data, epochs, t.batch_size, t.lr, gen, momentum=t.momentum,
                weight_decay=t.weight_decay, trainable=trainable)
    tuned = trainer.export()
    trainer.forget()
    return tuned


def states_fit(client: Client) -> bool:
    """Whether ``client``'s update is its ``fit_request`` and ``finish``, which the engine
    may then batch: what its class declares (``Client.batchable``)."""
    return type(client).batchable


class PersonalModelClient(Client):
    """A client whose personalized model persists in its state between rounds."""

    def init_state(self, cid: int, init_model: State) -> State:
        return model_to_state(init_model)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        return model_from_state(state)


@dataclass(frozen=True)
class PrivacySupport:
    """Which differential privacy (``privacy.level``, ``edgepfl.privacy``) an algorithm
    takes, declared by it and enforced by the engine, which refuses the rest naming
    ``refused``.

    ``client = "mean"``: every aggregation of client replies (the server's, or each edge's
    in a hierarchy) is a mean of the replies' models weighted by their ``num_samples``,
    every reply holding the client's trained version of floating-point entries of what it
    was sent. The engine then hands the aggregate clipped updates with equal weights and
    Gaussian noise on their sum (DP-FedAvg); the algorithm's own code never sees a raw
    reply. An aggregation that needs each client's own model (a relation matrix, a
    clustering, per-client weights) cannot take a noised sum instead and is refused.

    ``sample = True``: every computation on a client's training data is a gradient step of
    the client part's own trainer (``Trainer.fit``, ``run``), with no loss hook, and
    nothing else computed from the data leaves the client but ``num_samples``; the
    engine's trainer then runs DP-SGD. ``epochs``: passes over its data one update makes,
    from (``train`` settings, hyperparameters); None: ``train.local_epochs``.

    ``unaccounted``: for hyperparameters under which the algorithm computes on client data
    outside what either level accounts for (training at test time), the refusal, naming
    the setting and what is valid; None where there is no such work.

    ``unsummed``: for hyperparameters under which its aggregation needs more of the
    replies than their one sample-weighted mean (a second sum beside it), the refusal of
    ``privacy.secure_aggregation``, whose server learns that mean alone; None: it needs
    no more (a ``client = "mean"`` algorithm takes secure aggregation).
    """

    client: Literal["mean"] | None = None
    sample: bool = False
    refused: str = ""
    epochs: Callable[[TrainConfig, Any], int] | None = None
    unaccounted: Callable[[Any], str | None] | None = None
    unsummed: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    hyperparameters: type[Hyperparameters]
    server: type[Server]
    client: type[Client]
    paper: str = ""
    # appended to the data set's default model when model.name is left unset, if such a
    # model exists: FedBN is only FedBN on a model with BatchNorm ("_bn")
    model_variant: str = ""
    # the model when model.name is left unset, whatever the data set: an algorithm built
    # for its own architecture (HMPL's tier models) names it here
    default_model: str | None = None
    # the edge-server part of a client -> edge -> cloud algorithm (None: star only)
    edge: type[Edge] | None = None
    # whether it runs on clients of different architectures (model.tiers); an algorithm
    # whose maths needs one model for all (KAPC's relation cube) leaves it False
    heterogeneous: bool = False
    # whether it takes dataset.aspect_ratios, whose samples come in several shapes: an
    # algorithm that needs its data as one tensor of one shape (a public set, a fixed-size
    # batch in a message, statistics over data.x) sets False and is refused with them
    variable_size: bool = True
    # fills in hyperparameters whose defaults depend on the rest of the configuration
    # (FedMD's public data set: the other of MNIST and Fashion-MNIST), so that the resolved
    # config states them: (config, parsed hyperparameters) -> complete hyperparameters
    # (Any: each algorithm's own Hyperparameters class, which the callable takes)
    complete: Callable[[Any, Any], Hyperparameters] | None = None
    # the differential privacy it takes (privacy.level), and why it refuses the rest
    privacy: PrivacySupport = PrivacySupport(refused="its privacy has not been reviewed")
    # why it cannot serve a client that never trained (eval.new_clients): a method whose
    # server keeps only per-client models has nothing to give a stranger. Empty: it serves
    # one (Server.new_client_message, Client.new_client_model)
    no_new_clients: str = ""

    def parse_hyperparameters(self, values: dict[str, Any]) -> Hyperparameters:
        from pydantic import ValidationError

        from edgepfl.config import did_you_mean
        from edgepfl.errors import ConfigError

        try:
            return self.hyperparameters.model_validate(values)
        except ValidationError as exc:
            fields = self.hyperparameters.model_fields
            valid = ", ".join(fields) or "(none)"
            problems = []
            for err in exc.errors():
                # a check across settings has no one field: it names the algorithm's settings
                key = ".".join(["algorithm", *(str(p) for p in err["loc"])])
                if err["type"] == "extra_forbidden":
                    hint = did_you_mean(str(err["loc"][-1]), fields)
                    problems.append(f"{key} is not a hyperparameter of {self.name}{hint}; "
                                    f"valid: {valid}")
                else:
                    problems.append(f"{key} = {err.get('input')!r}: {err['msg']}")
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None

    def describe(self) -> list[tuple[str, str, str]]:
        return [(k, repr(f.default), f.description or "")
                for k, f in self.hyperparameters.model_fields.items()]

