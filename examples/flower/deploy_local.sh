#!/usr/bin/env bash
# A real Flower deployment on this machine: one SuperLink, one SuperNode per client, the app
# in this folder; then the same configuration in edgepfl's simulation, and the two runs'
# figures side by side (they should be equal).
#   examples/flower/deploy_local.sh [APP] [KEY=VALUE ...]   (from the repository root, venv active)
#   examples/flower/deploy_local.sh                         (this folder's app, its settings)
#   examples/flower/deploy_local.sh examples/flower/hierfavg   (client -> edge -> cloud)
#   examples/flower/deploy_local.sh examples/flower 'algorithm.name="fedavg"' partition.clients=3
#   INSECURE=1 examples/flower/deploy_local.sh         (no TLS, no node authentication)
#   ISOLATION=subprocess examples/flower/deploy_local.sh   (Flower's default isolation)
# KEY=VALUE: edgepfl settings in dotted form, values as TOML (strings quoted, as flwr's
# --run-config wants them: 'algorithm.name="fedavg"', privacy.secure_aggregation=true). They
# go to `flwr run --run-config`, to the node configs computed here (the partition count,
# the edges) and to the simulation at the end; a key the app's pyproject.toml does not list
# is added to a copy of the app (under $FLWR_HOME/app), since flwr refuses overrides of
# unlisted keys.
# Each SuperNode is started with its client's partition-id and, when the configuration has
# edge servers, the edge-id the federation gives that client.
# ISOLATION=process (the default): each SuperNode is started with `--isolation process` and
# beside it one long-lived ClientApp process, `python -m edgepfl.engine.flower_worker`
# (restarted if it dies), that runs the node's messages one after another, so that torch,
# edgepfl and the client's data are loaded once per node, not once per message: a round of
# three tiny clients takes about half the time of ISOLATION=subprocess, Flower's default, in
# which the SuperNode starts a fresh `flwr-clientapp` process for every message (figures:
# bench/checks/README.md, "Flower round latency"). It is as safe here: the connections to
# the SuperLink are the same (TLS, node authentication), the worker talks to its SuperNode
# over loopback only (127.0.0.1, plain HTTP, as Flower's own SuperExec does in subprocess
# isolation), and it runs one app: a message of another app gets a process of its own.
# What differs is that one app's messages on a node share a process (module globals and
# caches persist between them), which is the point.
# By default every connection is TLS, verified against a private CA, and the SuperLink
# admits only SuperNodes whose public key was registered (--enable-supernode-auth and
# `flwr supernode register`); make_certs.py next to this file makes what is missing in
# $CERTS (default runs/flower-certs): the CA, the SuperLink's certificate for 127.0.0.1,
# one key pair per client.
# Uses a private FLWR_HOME under runs/flower-home and the ports 8000 (SuperLink) and
# 9094.. (SuperNodes); everything it starts is stopped when it ends.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
app=$(cd "${1:-$here}" && pwd)
settings=("${@:2}")  # KEY=VALUE edgepfl settings
isolation=${ISOLATION:-process}
if [[ "$isolation" != process && "$isolation" != subprocess ]]; then
  echo "ISOLATION=$isolation: it must be process or subprocess" >&2
  exit 1
fi
root=$(pwd)
export FLWR_HOME="$root/runs/flower-home"
certs=$(realpath -m "${CERTS:-runs/flower-certs}")
mkdir -p "$FLWR_HOME"
if ((${#settings[@]})); then
  # flwr run refuses overrides of keys the app does not list: a copy of the app lists them
  python - "$app" "$FLWR_HOME/app" "${settings[@]}" <<'PY'
import json, re, shutil, sys, tomllib
from pathlib import Path
from flwr.common.config import parse_config_args
src, dst, sets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
for item in sets:
    if not re.fullmatch(r"[^=\s]+=.+", item):
        sys.exit(f"{item!r} is not KEY=VALUE (e.g. 'algorithm.name=\"fedavg\"' train.rounds=5)")
# one string: flwr 1.42 parses each argument alone and a later privacy.* would
# replace an earlier one
over = parse_config_args([" ".join(sets)])
if "out" in over:
    sys.exit("out= is this script's own (runs/flower-<algorithm>)")
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
text = (dst / "pyproject.toml").read_text()
listed = tomllib.loads(text)["tool"]["flwr"]["app"]["config"]
added = "".join(f"{json.dumps(k)} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}\n"
                for k, v in over.items() if k not in listed)
head = re.search(r"^\[tool\.flwr\.app\.config\][ \t]*$", text, re.M)
(dst / "pyproject.toml").write_text(text[:head.end()] + "\n" + added + text[head.end() + 1:])
PY
  app="$FLWR_HOME/app"
fi
# one line per client: "partition-id=K num-partitions=N[ edge-id=E]", from the federation
mapfile -t node_configs < <(python - "$app/pyproject.toml" "${settings[@]}" <<'PY'
import sys, tomllib
from flwr.common.config import parse_config_args
from edgepfl.engine.flower import SERVER_KEYS, config_from_run
from edgepfl.federation.topology import Federation
conf = tomllib.load(open(sys.argv[1], "rb"))["tool"]["flwr"]["app"]["config"]
conf = {**conf, **parse_config_args([" ".join(sys.argv[2:])])}
cfg = config_from_run({k: v for k, v in conf.items() if k not in SERVER_KEYS})
fed = Federation.build(cfg, cfg.partition.clients)
print(cfg.algorithm.name)
for cid, parent in enumerate(fed.parent):
    edge = f" edge-id={parent}" if fed.hierarchical else ""
    print(f"partition-id={cid} num-partitions={fed.num_clients}{edge}")
PY
)
algorithm=${node_configs[0]}
node_configs=("${node_configs[@]:1}")
clients=${#node_configs[@]}
if [[ "${INSECURE:-0}" == 1 ]]; then
  echo "WARNING: INSECURE=1: plain HTTP between SuperLink, SuperNodes and flwr, and any" \
       "SuperNode that reaches port 8000 may join and receive the model. Use on a trusted" \
       "machine only." >&2
  link_security=(--insecure)
  connection='insecure = true'
else
  python "$here/make_certs.py" "$certs" --nodes "$clients"
  link_security=(--ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.crt"
                 --ssl-keyfile "$certs/server.key" --enable-supernode-auth)
  # the flwr CLI and the SuperNodes trust this CA only, not the system's
  connection="root-certificates = \"$certs/ca.crt\""
fi
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = "127.0.0.1:8000"
$connection
TOML
pids=()
# each in its own process group, so that stopping it stops the processes it spawned too
trap 'for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done' EXIT
# edgepfl is installed in this environment, so the apps need no per-run install
setsid flower-superlink "${link_security[@]}" --disable-runtime-dependency-installation \
  > "$FLWR_HOME/superlink.log" 2>&1 &
pids+=($!)
for ((t = 0; ; t++)); do
  flwr supernode ls local > /dev/null 2>&1 && break
  if ((t >= 60)) || ! kill -0 "${pids[0]}" 2>/dev/null; then
    echo "the SuperLink did not start; see $FLWR_HOME/superlink.log" >&2
    tail -5 "$FLWR_HOME/superlink.log" >&2
    exit 1
  fi
  sleep 1
done
for ((k = 0; k < clients; k++)); do
  if [[ "${INSECURE:-0}" == 1 ]]; then
    node_security=(--insecure)
  else
    # the SuperLink's state is in memory: a fresh SuperLink knows no node until told
    flwr supernode register "$certs/node$k.pub" local > /dev/null
    node_security=(--root-certificates "$certs/ca.crt" --auth-supernode-private-key "$certs/node$k.key")
  fi
  setsid flower-supernode "${node_security[@]}" --superlink 127.0.0.1:8000 --port $((9094 + k)) \
    --isolation "$isolation" --node-config "${node_configs[$k]}" > "$FLWR_HOME/node$k.log" 2>&1 &
  pids+=($!)
  if [[ "$isolation" == process ]]; then
    # the node's long-lived ClientApp, on its Runtime API (loopback), restarted if it dies
    setsid bash -c "while true; do python -m edgepfl.engine.flower_worker \
      --runtime-api-address 127.0.0.1:$((9094 + k)) --insecure --preload edgepfl.engine.flower
      sleep 1; done" \
      > "$FLWR_HOME/worker$k.log" 2>&1 &
    pids+=($!)
  fi
done
if [[ "${INSECURE:-0}" != 1 ]]; then
  echo "TLS with CA $certs/ca.crt; SuperNode authentication: $clients registered key(s)"
fi
out="$root/runs/flower-$algorithm"
rm -rf "$out" "$out-simulation"
echo "isolation: $isolation"
run_config=(--run-config "out=\"$out\"")
# in one --run-config: flwr 1.42 reads each alone, and of two settings that share a
# section (privacy.level, privacy.clip) it would keep only the last
if ((${#settings[@]})); then run_config+=(--run-config "${settings[*]}"); fi
flwr run "$app" local --stream "${run_config[@]}"
python - "$app/pyproject.toml" "$out" "${settings[@]}" <<'PY'
import csv, sys, tomllib
from edgepfl.config import build_config
from edgepfl.engine.flower import SERVER_KEYS
from edgepfl.engine.simulation import Simulation
conf = tomllib.load(open(sys.argv[1], "rb"))["tool"]["flwr"]["app"]["config"]
sets = [f"{k}={v}" for k, v in conf.items() if k not in SERVER_KEYS]  # the ServerApp's own
# the command line's KEY=VALUE (TOML values, as --set reads them) over the app's
sets += [kv for kv in sys.argv[3:] if kv.split("=", 1)[0] not in SERVER_KEYS]
sim = Simulation(build_config({}, sets + ["output.plots=false"]), progress=False).run()
flower = list(csv.DictReader(open(f"{sys.argv[2]}/metrics.csv")))
print("round  acc_mean flower / simulation   bytes_up flower / simulation"
      "   bytes_up_edge flower / simulation")
for f, s in zip(flower, sim.metrics, strict=True):
    print(f"{f['round']:>5}  {float(f['acc_mean']):.6f} / {s['acc_mean']:.6f}"
          f"          {f['bytes_up']} / {s['bytes_up']}"
          f"          {f['bytes_up_edge']} / {s['bytes_up_edge']}")
PY
