#!/usr/bin/env bash
# The dev cluster's network: its nodes (n1, n2) and an outsider host, each a network namespace of its
# own on a private bridge, as separate machines on a cluster network would be.
#   bash slurm/dev/hosts.sh up     # make them (root); exit 1 saying why when they cannot be made
#   bash slurm/dev/hosts.sh down   # remove what `up` made (its record: $NEXRL_SLURM_DIR/run/hosts.made)
#
# Namespace nexrl-<host> gets a veth pair: inside, `eth0` (named like a cluster node's NIC) with
# $NEXRL_SLURM_NET.<n>/24 and its own `lo`; outside, a link of the namespace's name on the bridge
# nexrl-br, which holds $NEXRL_SLURM_NET.1 (the host's side: slurmctld and slurmdbd are reached
# there). /etc/netns/<namespace>/hosts (shown as /etc/hosts to what `ip netns exec` starts) names
# every host, so a node's hostname resolves to its own address as on a cluster. Everything made is
# recorded as it is made; `down` removes exactly that, in reverse, after ending the processes still
# in those namespaces (job steps of the dev cluster left behind).
set -eEuo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
D="$NEXRL_SLURM_DIR"
NET="${NEXRL_SLURM_NET:-10.77.0}"  # the first three octets of the dev cluster's /24
BR=nexrl-br
made="$D/run/hosts.made"
# name, address: the nodes, then the outsider (on the network, in no job)
HOSTS=("n1 $NET.11" "n2 $NET.12" "outsider $NET.99")

note() { echo "$*" >> "$made"; }

down() {
  [[ -f "$made" ]] || return 0
  local kind name pids
  while read -r kind name; do
    [[ "$kind" == netns ]] || continue
    pids="$(ip netns pids "$name" 2>/dev/null || true)"
    [[ -n "$pids" ]] && kill -9 $pids 2>/dev/null || true
  done < "$made"
  tac "$made" | while read -r kind name; do
    case "$kind" in
      netns) ip netns del "$name" 2>/dev/null || true ;;
      link) ip link del "$name" 2>/dev/null || true ;;
      file) rm -f "$name" ;;
      dir) rmdir --ignore-fail-on-non-empty "$name" 2>/dev/null || true ;;
    esac
  done
  rm -f "$made"
}

up() {
  [[ $(id -u) -eq 0 ]] || { echo "network namespaces need root" >&2; return 1; }
  command -v ip >/dev/null || { echo "iproute2's ip is not installed" >&2; return 1; }
  command -v unshare >/dev/null || { echo "util-linux's unshare is not installed" >&2; return 1; }
  [[ "$NET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || { echo "NEXRL_SLURM_NET=$NET: give 3 octets, e.g. 10.77.0" >&2; return 1; }
  down  # what an earlier `up` of this cluster left
  mkdir -p "$D/run"
  local entry host addr ns
  for entry in "${HOSTS[@]}"; do
    ns="nexrl-${entry%% *}"
    if ip netns list | grep -qw "^$ns"; then
      echo "network namespace $ns exists but this dev cluster ($D) did not make it: remove it (ip netns del $ns)" >&2
      return 1
    fi
  done
  if ip link show "$BR" >/dev/null 2>&1; then
    echo "link $BR exists but this dev cluster ($D) did not make it: remove it (ip link del $BR)" >&2
    return 1
  fi
  if ip -4 -o addr show | grep -q " inet $NET\." || ip -4 route show | grep -q "^$NET\."; then
    echo "this host already uses $NET.0/24: set NEXRL_SLURM_NET to a free /24 (e.g. 10.78.0)" >&2
    return 1
  fi
  ip link add "$BR" type bridge
  note link "$BR"
  ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  [[ -d /etc/netns ]] || { mkdir /etc/netns; note dir /etc/netns; }
  for entry in "${HOSTS[@]}"; do
    host="${entry%% *}" addr="${entry##* }" ns="nexrl-${entry%% *}"
    ip netns add "$ns"
    note netns "$ns"
    ip link add "$ns" type veth peer name eth0 netns "$ns"
    note link "$ns"
    ip link set "$ns" master "$BR" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    mkdir -p "/etc/netns/$ns"
    note dir "/etc/netns/$ns"
    {
      printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n%s\tnexrl-ctl\n' "$NET.1"
      for e in "${HOSTS[@]}"; do printf '%s\t%s\n' "${e##* }" "${e%% *}"; done
    } > "/etc/netns/$ns/hosts"
    note file "/etc/netns/$ns/hosts"
  done
}

case "${1:-}" in
  up)
    # any failing command (set -e; -E: inside functions too) undoes what was made so far
    trap 'echo "slurm/dev/hosts.sh: failed at line $LINENO" >&2; trap - ERR; down; exit 1' ERR
    up
    trap - ERR
    ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
