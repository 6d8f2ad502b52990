#!/usr/bin/env bash
# Stop the dev cluster's daemons — only the PIDs it recorded under $NEXRL_SLURM_DIR/run — then remove
# the namespaces, links and files slurm/dev/hosts.sh made (only those: its record says which).
set -uo pipefail
source "$(cd "$(dirname "$0")" && pwd)/env.sh"
D="$NEXRL_SLURM_DIR"
for name in slurmd.n1 slurmd.n2 slurmctld slurmdbd mysqld munged; do
  f="$D/run/$name.pid"
  [[ -f "$f" ]] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$f"
done
bash "$(dirname "$0")/hosts.sh" down
rm -f "$D/run/hosts.json"
echo "dev cluster stopped"
