"""Flower's PyTorch quickstart (``flwr new``, PyTorch template) on edgepfl's tiny task, for
``bench/checks/flower_rounds.py``: FedAvg, a ClientApp that trains and evaluates
``cnn_small`` (edgepfl's model for 8x8 images, written out here) on its share of a seeded
synthetic data set. It imports no edgepfl. With the environment variable
``FLOWER_ROUNDS_TIMING`` set (a folder) in the SuperNode's environment, each message
appends one JSON line of timers to ``$FLOWER_ROUNDS_TIMING/clientapp.jsonl`` (what the
benchmark splits a round into)."""

from __future__ import annotations

import time

MODULE_START = time.time()  # the ClientApp process has started and pulled its message

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from torch import nn  # noqa: E402

MODULE_END = time.time()


def process_start() -> float:
    """When this process started (Unix time, from /proc; 0 where there is none)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat")
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return 0.0


def record(context: Context, msg: Message, **marks: float) -> None:
    folder = os.environ.get("FLOWER_ROUNDS_TIMING")
    if not folder:
        return
    line = {"app": "quickstart", "pid": os.getpid(), "type": msg.metadata.message_type,
            "round": msg.metadata.group_id, "node": context.node_config.get("partition-id"),
            "proc_start": process_start(), "module_start": MODULE_START,
            "module_end": MODULE_END, **marks}
    with open(Path(folder) / "clientapp.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


class Net(nn.Module):
    """edgepfl's ``cnn_small``: two 3x3 convolutions (16, 32), a 2x2 max-pool, FC 64, FC 10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load_data(partition: int, partitions: int, samples: int, batch: int):
    """This client's train and test loaders: an equal share of ``samples`` seeded images
    (class means plus noise), 80% train. The quickstart loads a CIFAR-10 partition here."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (samples,), generator=g)
    means = torch.randn(10, 1, 8, 8, generator=g)
    x = means[y] + torch.randn(samples, 1, 8, 8, generator=g)
    share = torch.arange(partition, samples, partitions)
    cut = int(0.8 * len(share))
    data = torch.utils.data.TensorDataset
    train = torch.utils.data.DataLoader(data(x[share[:cut]], y[share[:cut]]),
                                        batch_size=batch, shuffle=True)
    test = torch.utils.data.DataLoader(data(x[share[cut:]], y[share[cut:]]), batch_size=batch)
    return train, test


client_app = ClientApp()


def _setup(msg: Message, context: Context):
    cfg = context.run_config
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    train, test = load_data(int(context.node_config["partition-id"]),
                            int(context.node_config["num-partitions"]), int(cfg["samples"]),
                            int(cfg["batch-size"]))
    return model, train, test


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    call = time.time()
    model, trainloader, _ = _setup(msg, context)
    data = time.time()
    opt = torch.optim.SGD(model.parameters(), lr=float(context.run_config["lr"]))
    model.train()
    loss = 0.0
    for _ in range(int(context.run_config["local-epochs"])):
        for xb, yb in trainloader:
            opt.zero_grad()
            batch_loss = F.cross_entropy(model(xb), yb)
            batch_loss.backward()
            opt.step()
            loss += float(batch_loss)
    work = time.time()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss / len(trainloader),
                                                   "num-examples": len(trainloader.dataset)})})
    reply = Message(content=content, reply_to=msg)
    record(context, msg, call=call, data=data, work=work, reply=time.time())
    return reply


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    call = time.time()
    model, _, testloader = _setup(msg, context)
    data = time.time()
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for xb, yb in testloader:
            out = model(xb)
            loss += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    n = len(testloader.dataset)
    work = time.time()
    reply = Message(content=RecordDict({"metrics": MetricRecord(
        {"eval_loss": loss / n, "eval_acc": correct / n, "num-examples": n})}), reply_to=msg)
    record(context, msg, call=call, data=data, work=work, reply=time.time())
    return reply


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    marks: list[float] = []

    def mark(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        marks.append(time.time())  # round 0 before the first round, then after each
        return None

    nodes = int(cfg["min-nodes"])
    strategy = FedAvg(fraction_train=float(cfg["fraction-train"]),
                      fraction_evaluate=float(cfg["fraction-evaluate"]),
                      min_train_nodes=nodes, min_evaluate_nodes=nodes, min_available_nodes=nodes)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=mark)
    if cfg.get("out"):
        Path(str(cfg["out"])).write_text(json.dumps(
            {"ends": marks, "wall_s": [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]}))
