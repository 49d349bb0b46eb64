"""FedAvg's ClientApp as Flower's PyTorch quickstart writes it, for ``flower_sim.py``.

A module of its own because Flower's simulation runs ClientApps in Ray worker processes,
which import it by name (``flower_sim.py`` puts this folder on their ``PYTHONPATH``); a
function defined in the benchmark's ``__main__`` would be shipped by value and lose its
per-process data cache. The data are this client's share of edgepfl's partition, decoded
once per worker process.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edgepfl.config import build_config
from edgepfl.engine.simulation import load_federation
from edgepfl.models import build_model


@lru_cache(maxsize=1)
def shares(sets: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int]:
    """The training tensors, each client's indices and the class count for edgepfl
    settings ``sets``."""
    ds, part = load_federation(build_config({}, list(sets)))
    return ds.images("train"), ds.y_train, part.train, ds.num_classes


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    x, y, parts, classes = shares(tuple(config["sets"]))
    idx = parts[int(context.node_config["partition-id"])]
    model = build_model(str(config["model"]), tuple(x.shape[1:]), classes)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[idx], y[idx]),
                                         batch_size=int(config["batch-size"]), shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    model.train()
    for _ in range(int(config["local-epochs"])):
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": len(idx)})})
    return Message(content=content, reply_to=msg)
