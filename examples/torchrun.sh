#!/usr/bin/env bash
# thinwire train under torchrun: 2 CPU processes on this machine. On a cluster, run the same
# command on every node with --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT.
set -euo pipefail
torchrun --nproc-per-node 2 -m thinwire train --task mnist1d --method powersgd:rank=2 --steps 200 "$@"
