#!/usr/bin/env bash
# Start a throw-away Slurm cluster on this host: munge, a private MariaDB + slurmdbd (so sacct
# works), slurmctld and two slurmd "nodes" (n1, n2), a default partition and a high-priority one
# (for real preemption). Everything lives under $NEXRL_SLURM_DIR; idempotent; needs root.
#   bash slurm/dev/start.sh && source slurm/dev/env.sh && sinfo
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
D="$NEXRL_SLURM_DIR"
[[ $(id -u) -eq 0 ]] || { echo "slurm/dev/start.sh must run as root (the dev cluster's daemons run as root)" >&2; exit 1; }
bash "$here/install.sh"

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if alive "$D/run/slurmctld.pid" && alive "$D/run/slurmd.n1.pid" && alive "$D/run/slurmd.n2.pid"; then
  sinfo -h >/dev/null 2>&1 && { echo "dev cluster already running ($D)"; exit 0; }
fi
bash "$here/stop.sh" >/dev/null 2>&1 || true

mkdir -p "$D"/{etc,run,log,state,spool,tmp/n1,tmp/n2,munge,munge-key,mysql}
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
SlurmctldHost=localhost(127.0.0.1)
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
AccountingStorageHost=localhost
AccountingStoragePort=16819
AccountingStoragePass=$sock
JobCompType=jobcomp/none
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=4 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=high Nodes=n[1-2] MaxTime=INFINITE State=UP PriorityTier=10
CONF

# slurmdbd reads slurmdbd.conf beside $SLURM_CONF
MYSQL_UNIX_PORT="$D/run/mysql.sock" slurmdbd
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
sacctmgr -i add cluster nexrl >/dev/null 2>&1 || true
slurmctld -c -f "$D/etc/slurm.conf"
slurmd -N n1 -f "$D/etc/slurm.conf"
slurmd -N n2 -f "$D/etc/slurm.conf"
for _ in $(seq 300); do
  states=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  [[ "$states" == "idle " ]] && { echo "dev cluster up: SLURM_CONF=$SLURM_CONF (2 nodes idle)"; exit 0; }
  sleep 0.2
done
echo "dev cluster did not come up (node states: ${states:-none}); logs in $D/log" >&2
exit 1
