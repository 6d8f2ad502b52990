#!/usr/bin/env bash
# Start a throw-away Slurm cluster on this host: munge, a private MariaDB + slurmdbd (so sacct
# works), slurmctld and two slurmd "nodes" (n1, n2), a default partition and a high-priority one
# (for real preemption). Everything lives under $NEXRL_SLURM_DIR; idempotent; needs root.
#   bash slurm/dev/start.sh && source slurm/dev/env.sh && sinfo
#
# Two hosts: each slurmd runs in a network namespace of its own (slurm/dev/hosts.sh: eth0 with
# $NEXRL_SLURM_NET.11 / .12 on a private bridge) and a UTS namespace with its own hostname (n1, n2),
# so a job's processes, which inherit both, are on two hosts as on a cluster: a loopback address is
# one host's only, MPI and torch.distributed go over eth0, and anything keyed on the hostname sees
# two. slurmctld and slurmdbd listen on the bridge's host address ($NEXRL_SLURM_NET.1; a namespace
# cannot reach the host's 127.0.0.1); munge's socket is a path, the same file in every namespace.
# Where namespaces cannot be made (or NEXRL_SLURM_HOSTS=loopback) it says so and runs both nodes on
# 127.0.0.1 of this host instead. $NEXRL_SLURM_DIR/run/hosts.json says which, and why.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
D="$NEXRL_SLURM_DIR"
[[ $(id -u) -eq 0 ]] || { echo "slurm/dev/start.sh must run as root (the dev cluster's daemons run as root)" >&2; exit 1; }
bash "$here/install.sh"

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if alive "$D/run/slurmctld.pid" && alive "$D/run/slurmd.n1.pid" && alive "$D/run/slurmd.n2.pid" \
    && [[ -f "$D/run/hosts.json" ]]; then
  sinfo -h >/dev/null 2>&1 && { echo "dev cluster already running ($D)"; exit 0; }
fi
bash "$here/stop.sh" >/dev/null 2>&1 || true

mkdir -p "$D"/{etc,run,log,state,spool,tmp/n1,tmp/n2,munge,munge-key,mysql}
NET="${NEXRL_SLURM_NET:-10.77.0}"
mode=loopback
if [[ "${NEXRL_SLURM_HOSTS:-netns}" == loopback ]]; then
  reason="NEXRL_SLURM_HOSTS=loopback"
elif bash "$here/hosts.sh" up 2>"$D/log/hosts.err"; then
  mode=netns reason=""
else
  reason="network namespaces could not be made: $(head -n 1 "$D/log/hosts.err")"
  echo "$reason; falling back to one host (both nodes on 127.0.0.1): tests that need two hosts will fail" >&2
fi
if [[ $mode == netns ]]; then
  ctl="$NET.1"
  nodes="NodeName=n1 NodeHostname=n1 NodeAddr=$NET.11 Port=17001 CPUs=4 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=$NET.12 Port=17001 CPUs=4 RealMemory=8000 State=UNKNOWN"
else
  ctl=127.0.0.1
  nodes="NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=4 RealMemory=8000 State=UNKNOWN"
fi
chmod 755 "$D" "$D/munge" "$D/run"
chmod 700 "$D/munge-key"
[[ -f "$D/munge-key/munge.key" ]] || { head -c 1024 /dev/urandom > "$D/munge-key/munge.key"; chmod 400 "$D/munge-key/munge.key"; }
sock="$D/munge/munge.socket.2"

munged --key-file="$D/munge-key/munge.key" --socket="$sock" --pid-file="$D/run/munged.pid" \
  --log-file="$D/log/munged.log" --seed-file="$D/munge-key/munged.seed" --force

if [[ ! -d "$D/mysql/mysql" ]]; then
  mariadb-install-db --datadir="$D/mysql" --user=root --skip-test-db >"$D/log/mariadb-install.log" 2>&1
fi
mariadbd --datadir="$D/mysql" --socket="$D/run/mysql.sock" --port=13306 --bind-address=127.0.0.1 --user=root \
  --pid-file="$D/run/mysqld.pid" --log-error="$D/log/mysqld.log" --skip-log-bin >/dev/null 2>&1 &
for _ in $(seq 100); do [[ -S "$D/run/mysql.sock" ]] && break; sleep 0.1; done

cat > "$D/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$sock
DbdHost=localhost
DbdAddr=$ctl
DbdPort=16819
SlurmUser=root
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=nexrl_slurm_acct
CONF
chmod 600 "$D/etc/slurmdbd.conf"

cat > "$D/etc/slurm.conf" <<CONF
ClusterName=nexrl
SlurmctldHost=localhost($ctl)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
AuthType=auth/munge
AuthInfo=socket=$sock,cred_expire=5
CryptoType=crypto/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=10
InactiveLimit=0
MinJobAge=60
KillWait=5
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
SlurmdParameters=config_overrides
TmpFS=$D/tmp/%n
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$ctl
AccountingStoragePort=16819
AccountingStoragePass=$sock
JobCompType=jobcomp/none
$nodes
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=high Nodes=n[1-2] MaxTime=INFINITE State=UP PriorityTier=10
CONF

# slurmdbd reads slurmdbd.conf beside $SLURM_CONF
MYSQL_UNIX_PORT="$D/run/mysql.sock" slurmdbd
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
sacctmgr -i add cluster nexrl >/dev/null 2>&1 || true
slurmctld -c -f "$D/etc/slurm.conf"
for n in n1 n2; do
  if [[ $mode == netns ]]; then
    # its host: the node's network namespace, a hostname of its own, its /etc/hosts (a mount
    # namespace of its own, following the host's mounts). Not `ip netns exec`: it remounts /sys,
    # which hides the cgroup mounts slurmd 22.05 insists on.
    nsenter --net="/run/netns/nexrl-$n" unshare --uts --mount --propagation slave sh -c \
      "mount --bind /etc/netns/nexrl-$n/hosts /etc/hosts && hostname $n && exec slurmd -N $n -f '$D/etc/slurm.conf'"
  else
    slurmd -N "$n" -f "$D/etc/slurm.conf"
  fi
done
# what the tests and tests/helpers/hosts.py read: which hosts, their addresses, and the outsider
# (a host on the cluster network that is in no job)
if [[ $mode == netns ]]; then
  cat > "$D/run/hosts.json" <<JSON
{"mode": "netns", "reason": null, "interface": "eth0", "network": "$NET.0/24", "controller": "$ctl",
 "nodes": [{"name": "n1", "netns": "nexrl-n1", "hostname": "n1", "address": "$NET.11"},
           {"name": "n2", "netns": "nexrl-n2", "hostname": "n2", "address": "$NET.12"}],
 "outsider": {"netns": "nexrl-outsider", "hostname": "outsider", "address": "$NET.99"}}
JSON
else
  cat > "$D/run/hosts.json" <<JSON
{"mode": "loopback", "reason": "${reason//\"/\'}", "interface": null, "network": null, "controller": "$ctl",
 "nodes": [{"name": "n1", "netns": null, "hostname": "$(hostname)", "address": "127.0.0.1"},
           {"name": "n2", "netns": null, "hostname": "$(hostname)", "address": "127.0.0.1"}],
 "outsider": null}
JSON
fi
for _ in $(seq 300); do
  states=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  if [[ "$states" == "idle " ]]; then
    # the two hosts reach each other (not only the controller): srun's PMI and the job's ranks need it
    if [[ $mode == netns ]] && ! ip netns exec nexrl-n1 timeout 5 bash -c "exec 3<>/dev/tcp/$NET.12/17001"; then
      echo "dev cluster up, but n1 cannot reach n2 ($NET.12:17001) over the bridge (a firewall on bridged traffic?)" >&2
      exit 1
    fi
    echo "dev cluster up: SLURM_CONF=$SLURM_CONF (2 nodes idle; hosts: $mode${reason:+, $reason})"
    exit 0
  fi
  sleep 0.2
done
echo "dev cluster did not come up (node states: ${states:-none}); logs in $D/log" >&2
exit 1
