#!/usr/bin/env bash
# A real Flower deployment on this machine: one SuperLink, one SuperNode per client (each
# ClientApp in its own process), the app in this folder; then the same configuration in
# edgepfl's simulation, and the two runs' figures side by side (they should be equal).
#   examples/flower/deploy_local.sh                    (from the repository root, venv active)
#   examples/flower/deploy_local.sh examples/flower/hierfavg   (client -> edge -> cloud)
#   INSECURE=1 examples/flower/deploy_local.sh         (no TLS, no node authentication)
# Each SuperNode is started with its client's partition-id and, when the configuration has
# edge servers, the edge-id the federation gives that client.
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
root=$(pwd)
export FLWR_HOME="$root/runs/flower-home"
certs=$(realpath -m "${CERTS:-runs/flower-certs}")
mkdir -p "$FLWR_HOME"
# one line per client: "partition-id=K num-partitions=N[ edge-id=E]", from the federation
mapfile -t node_configs < <(python - "$app/pyproject.toml" <<'PY'
import sys, tomllib
from edgepfl.engine.flower import config_from_run
from edgepfl.federation.topology import Federation
conf = tomllib.load(open(sys.argv[1], "rb"))["tool"]["flwr"]["app"]["config"]
cfg = config_from_run({k: v for k, v in conf.items() if k not in ("out", "wait", "timeout")})
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
    --node-config "${node_configs[$k]}" > "$FLWR_HOME/node$k.log" 2>&1 &
  pids+=($!)
done
if [[ "${INSECURE:-0}" != 1 ]]; then
  echo "TLS with CA $certs/ca.crt; SuperNode authentication: $clients registered key(s)"
fi
out="$root/runs/flower-$algorithm"
rm -rf "$out" "$out-simulation"
flwr run "$app" local --stream --run-config "out=\"$out\""
python - "$app/pyproject.toml" "$out" <<'PY'
import csv, sys, tomllib
from edgepfl.config import build_config
from edgepfl.engine.flower import SERVER_KEYS
from edgepfl.engine.simulation import Simulation
conf = tomllib.load(open(sys.argv[1], "rb"))["tool"]["flwr"]["app"]["config"]
sets = [f"{k}={v}" for k, v in conf.items() if k not in SERVER_KEYS]  # the ServerApp's own
sim = Simulation(build_config({}, sets + ["output.plots=false"]), progress=False).run()
flower = list(csv.DictReader(open(f"{sys.argv[2]}/metrics.csv")))
print("round  acc_mean flower / simulation   bytes_up flower / simulation"
      "   bytes_up_edge flower / simulation")
for f, s in zip(flower, sim.metrics, strict=True):
    print(f"{f['round']:>5}  {float(f['acc_mean']):.6f} / {s['acc_mean']:.6f}"
          f"          {f['bytes_up']} / {s['bytes_up']}"
          f"          {f['bytes_up_edge']} / {s['bytes_up_edge']}")
PY
