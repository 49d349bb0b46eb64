"""The algorithm contract: a server part and a client part that only exchange messages.

* ``Server.configure`` says what each selected client receives this round;
  ``Server.aggregate`` folds the replies into server state.
* ``Client.update`` trains one client, given the message and that client's persistent
  state, and returns the reply and the new state. One ``Client`` object serves every
  simulated client, so it must keep no per-client memory of its own: everything a
  client remembers between rounds lives in the ``state`` mapping, which the engine keeps
  stacked (and which on Flower lives with the real client).
* Evaluation: ``Server.eval_message`` is what a client would hold to predict with (the
  global model for FedAvg, nothing for methods whose personal model stays on the client);
  ``Client.personal_model`` turns that and the client's state into the model it predicts
  with. Evaluation traffic is a measurement, not protocol, so it is not counted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from edgepfl.algorithms.training import ClientData, Trainer
from edgepfl.config import TrainConfig
from edgepfl.federation.messages import Message
from edgepfl.models.layers import LayerSpec

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

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass
class ServerContext:
    num_clients: int
    layers: LayerSpec
    init_model: State
    train: TrainConfig
    seed: int


@dataclass
class ClientContext:
    trainer: Trainer
    layers: LayerSpec
    train: TrainConfig
    num_classes: int
    seed: int


@dataclass
class UpdateResult:
    reply: Message
    state: State
    stats: dict[str, float] = field(default_factory=dict)


class Server(ABC):
    def __init__(self, ctx: ServerContext, hp: Any):
        self.ctx = ctx
        self.hp = hp

    @abstractmethod
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]: ...

    @abstractmethod
    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None: ...

    def eval_message(self, cid: int) -> Message | None:
        return None

    def state_dict(self) -> State:
        """Tensors the server needs to resume (checkpointed after every round)."""
        return {}

    def load_state_dict(self, state: State) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state but got {sorted(state)}")

    def round_metrics(self) -> dict[str, float]:
        """Algorithm-specific per-round figures for metrics.csv (e.g. layers uploaded)."""
        return {}

    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        """Algorithm-specific files for the run directory (e.g. a relation-matrix heatmap),
        written when the run ends; use ``edgepfl.io`` so writes are atomic."""
        return None


class Client(ABC):
    def __init__(self, ctx: ClientContext, hp: Any):
        self.ctx = ctx
        self.hp = hp
        self.trainer = ctx.trainer

    def init_state(self, cid: int, init_model: State) -> State:
        """State of a client before its first round (default: none)."""
        return {}

    @abstractmethod
    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult: ...

    @abstractmethod
    def personal_model(self, state: State, eval_msg: Message | None) -> State: ...


class PersonalModelClient(Client):
    """A client whose personalized model persists in its state between rounds."""

    def init_state(self, cid: int, init_model: State) -> State:
        return model_to_state(init_model)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        return model_from_state(state)


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

    def parse_hyperparameters(self, values: dict[str, Any]) -> Hyperparameters:
        from pydantic import ValidationError

        from edgepfl.errors import ConfigError

        try:
            return self.hyperparameters.model_validate(values)
        except ValidationError as exc:
            fields = self.hyperparameters.model_fields
            valid = ", ".join(fields) or "(none)"
            problems = []
            for err in exc.errors():
                key = "algorithm." + ".".join(str(p) for p in err["loc"])
                if err["type"] == "extra_forbidden":
                    problems.append(f"{key} is not a hyperparameter of {self.name}; valid: {valid}")
                else:
                    problems.append(f"{key} = {err.get('input')!r}: {err['msg']}")
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None

    def describe(self) -> list[tuple[str, str, str]]:
        return [(k, repr(f.default), f.description or "")
                for k, f in self.hyperparameters.model_fields.items()]

