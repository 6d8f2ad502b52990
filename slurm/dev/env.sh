# Source me: point Slurm clients (sbatch, srun, squeue, sacct, submitit) at the dev cluster.
#   source slurm/dev/env.sh
export NEXRL_SLURM_DIR="${NEXRL_SLURM_DIR:-/tmp/nexrl-slurm-dev}"
export SLURM_CONF="$NEXRL_SLURM_DIR/etc/slurm.conf"
