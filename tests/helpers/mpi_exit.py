"""One rank's end of a run as ``launch.train`` does it: MPI_Finalize, then ``exit_process``.

The ranks leave one after another (rank 0 last, as its interpreter has the most to tear down): a
rank still running when another has gone is what Hydra kills if that exit looked abnormal to it.

``python -m tests.helpers.mpi_exit CODE [--os-exit]``: ``--os-exit`` leaves with ``os._exit``
instead (what the code did before), to show the test can tell the two apart.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from nexrl_hpc.runtime.mpi import exit_process, finalize_mpi, start_mpi
from tests.conftest import compose_config


def main() -> None:
    code = int(sys.argv[1])
    mpi = start_mpi(compose_config()["runtime"]["mpi_env"])
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread that never ends
    comm_size, rank = mpi.COMM_WORLD.Get_size(), mpi.COMM_WORLD.Get_rank()
    mpi.COMM_WORLD.Barrier()
    finalize_mpi(10.0, code)
    time.sleep(0.2 * (comm_size - 1 - rank))
    if "--os-exit" in sys.argv:
        os._exit(code)
    exit_process(code, 10.0)


if __name__ == "__main__":
    main()
