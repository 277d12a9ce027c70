#!/usr/bin/env bash
# Two "nodes" of two ranks on this machine, one torchrun launcher per node, as on a cluster
# (there, each node runs its own line with its --node-rank and the first node's address).
# Gradients are averaged uncompressed inside each node and through top-k between the nodes.
set -euo pipefail
PORT=${PORT:-29512}
for NODE in 0 1; do
  torchrun --nnodes 2 --nproc-per-node 2 --node-rank "$NODE" --master-addr 127.0.0.1 --master-port "$PORT" \
      -m thinwire train --task mnist1d --method topk:ratio=0.05 --ranks-per-node auto --steps 200 \
      --link 100mbit,1ms --quiet "$@" &
done
wait
