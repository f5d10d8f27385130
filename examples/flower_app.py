"""A Flower app on fedfeat's cached features: FedAvg of a linear head, one Flower client per fedfeat client.

The cache is shared by both worlds: the ``ClientApp`` reads its client's rows of a fedfeat store (features encoded
once by ``fedfeat encode``, or a ``fedfeat synth`` store) with ``fedfeat.integrations.flower.client_features``, for exactly the
client of the same id in a fedfeat partition; the ``ServerApp`` starts the head from the store's class-prompt
embeddings (round 0 = CLIP zero-shot) and evaluates it on the store's test split. No image is encoded here.

Run it with Flower's simulation engine (``pip install 'fedfeat[flower]' 'flwr[simulation]'``)::

    fedfeat synth                                             # cache/synth-cifar10.zarr, if you have no store yet
    python examples/flower_app.py --store cache/synth-cifar10.zarr --clients 10 --alpha 0.5 --rounds 5

It partitions the store's train split like ``fedfeat partition --scheme dirichlet`` (the partition is written to
``--out``/partition.json and every client reads it), or takes ``--partition KEY`` (stored in the store by
``fedfeat partition``) or ``--partition FILE.json`` (``fedfeat partition ... --export FILE.json``). Each round
samples ``--fraction`` of the clients; each trains the head for ``--epochs`` local epochs of SGD (momentum 0.9) on
its L2-normalised features, logits ``logit_scale * x @ W.T + b`` (CLIP's cosine geometry, the store's logit
scale); FedAvg weighs the clients by their sample counts. ``fedfeat train --method fedavg`` trains the same kind
of head with all sampled clients in one batched program; this app is the per-client Flower version of it.

``client_app`` and ``server_app`` are plain Flower apps: for ``flwr run`` (deployment), point a Flower project's
``[tool.flwr.app.components]`` at ``flower_app:server_app`` / ``flower_app:client_app`` and pass the settings in
its run config (keys ``store``, ``partition``, ``lr``, ``epochs``, ``batch-size``, ``fraction``,
``rounds``); the simulation below passes them through ``FEDFEAT_FLOWER_*`` environment variables instead.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedfeat import open_store
from fedfeat.integrations.flower import client_features, split_features, text_features

DEFAULTS = {"lr": 3e-4, "epochs": 2, "batch-size": 32, "fraction": 0.5, "rounds": 5, "seed": 0}


def setting(context: Context, key: str):
    """A run setting: the Flower run config's ``key``, else ``FEDFEAT_FLOWER_<KEY>``, else the default."""
    if key in context.run_config:
        return context.run_config[key]
    env = os.environ.get("FEDFEAT_FLOWER_" + key.upper().replace("-", "_"))
    if env is None:
        if key not in DEFAULTS:
            raise SystemExit(f"flower_app: set {key} in the run config or FEDFEAT_FLOWER_{key.upper()}")
        return DEFAULTS[key]
    return type(DEFAULTS[key])(env) if key in DEFAULTS else env


def logits(head: dict, x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * (x @ head["W"].T) + head["b"]  # [n, K]


# ----------------------------------------------------------------------------------------------- the client
client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local SGD on this node's fedfeat client (``partition-id`` = fedfeat's client id)."""
    client = int(context.node_config["partition-id"])
    store = open_store(setting(context, "store"))
    x, y = client_features(store, setting(context, "partition"), client, normalize=True, as_torch=True)
    head = {k: v.clone().requires_grad_() for k, v in msg.content["arrays"].to_torch_state_dict().items()}
    cfg = msg.content["config"]
    opt = torch.optim.SGD(list(head.values()), lr=float(cfg["lr"]), momentum=0.9)
    # a generator per client and round: the same seed gives the same run, whatever the scheduling
    gen = torch.Generator().manual_seed(
        int(cfg["seed"]) * 1_000_003 + int(cfg["server-round"]) * 1009 + client
    )
    bs, total = int(cfg["batch-size"]), 0.0
    for _ in range(int(cfg["epochs"])):
        for idx in torch.randperm(len(y), generator=gen).split(bs):
            loss = F.cross_entropy(logits(head, x[idx], store.logit_scale), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
    steps = max(int(cfg["epochs"]) * len(y), 1)
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: v.detach() for k, v in head.items()}),
            "metrics": MetricRecord({"train_loss": total / steps, "num-examples": len(y)}),
        }
    )
    return Message(content=content, reply_to=msg)


# ----------------------------------------------------------------------------------------------- the server
server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """FedAvg from the zero-shot head; every round evaluated on the store's test split."""
    store = open_store(setting(context, "store"))
    tx, ty = split_features(
        store, "test" if "test" in store.splits else "train", normalize=True, as_torch=True
    )
    text = torch.from_numpy(text_features(store))  # [K, D]: the zero-shot head
    init = {"W": text, "b": torch.zeros(store.n_classes)}

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        head = arrays.to_torch_state_dict()
        with torch.no_grad():
            acc = float((logits(head, tx, store.logit_scale).argmax(1) == ty).double().mean())
        print(f"round {server_round}: test accuracy {100 * acc:.2f}%")
        return MetricRecord({"accuracy": acc})

    strategy = FedAvg(
        fraction_train=float(setting(context, "fraction")), fraction_evaluate=0.0, min_train_nodes=1
    )
    keys = ("lr", "epochs", "batch-size", "seed")
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(init),
        num_rounds=int(setting(context, "rounds")),
        train_config=ConfigRecord({k: setting(context, k) for k in keys}),
        evaluate_fn=evaluate,
    )
    out = os.environ.get("FEDFEAT_FLOWER_OUT")
    if out:
        accs = {int(r): float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
        (Path(out) / "accuracy.json").write_text(json.dumps(accs))


# ----------------------------------------------------------------------------------------------- simulation
def simulate(argv: list[str] | None = None) -> None:
    """Partition the store (or take a given partition) and run both apps in Flower's simulation engine."""
    from flwr.simulation import run_simulation

    from fedfeat.integrations.flower import load_partition
    from fedfeat.partition.core import to_json
    from fedfeat.report.stores import store_partition

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="cache/synth-cifar10.zarr")
    ap.add_argument(
        "--partition", help="a key stored in the store, or a file from `fedfeat partition --export`"
    )
    ap.add_argument("--clients", type=int, default=10, help="dirichlet clients (without --partition)")
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha (without --partition)")
    ap.add_argument("--out", default="runs/flower", help="where partition.json and accuracy.json go")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    args = ap.parse_args(argv)
    store = open_store(args.store)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (
        args.partition is None
    ):  # fedfeat's dirichlet partition (FedNTD's algorithm and seed), kept with the run
        key, part = store_partition(
            store, scheme="dirichlet", clients=args.clients, alpha=args.alpha, save=False
        )
        args.partition = str((out / "partition.json").resolve())
        to_json(part, args.partition)
        print(f"partition {key}: {part.n_clients} clients, written to {args.partition}")
    part, _ = load_partition(args.partition, store)
    env = {"store": str(Path(args.store).resolve()), "partition": args.partition, "out": str(out.resolve())}
    env.update({k: getattr(args, k.replace("-", "_")) for k in DEFAULTS})
    for k, v in env.items():  # the simulation's app processes read their settings from the environment
        os.environ["FEDFEAT_FLOWER_" + k.upper().replace("-", "_")] = str(v)
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=part.n_clients,  # node i is fedfeat's client i (node_config["partition-id"])
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )


if __name__ == "__main__":
    simulate()
