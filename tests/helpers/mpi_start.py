"""One rank of the MPI start-up as ``run_mpi`` does it (the default config's ``runtime.mpi_env``).

The heap is dirtied first the way a rank's is after importing the library: MPICH's inter-node
business-card exchange publishes what the heap held, and some contents broke Slurm's pmi2 parsing
(MPI_Init then waits forever) with the UCX netmod.
"""

from __future__ import annotations

import os
import random

from nexrl_hpc.runtime.mpi import start_mpi
from tests.conftest import compose_config


def main() -> None:
    mpi_env = compose_config()["runtime"]["mpi_env"]
    rng = random.Random(os.getpid())
    binary = [os.urandom(rng.randint(16, 8192)) for _ in range(4000)]
    text = [("x" * rng.randint(1, 3) + str(i)) * 50 for i in range(4000)]
    del binary, text
    mpi = start_mpi(mpi_env)
    comm = mpi.COMM_WORLD
    ranks = comm.allgather(comm.Get_rank())
    if comm.Get_rank() == 0:
        print(f"started {ranks}", flush=True)


if __name__ == "__main__":
    main()
