"""The login-node check that a job can ever start, on partitions unlike the dev cluster's (GPU nodes,
mixed node sizes, time limits): sinfo output as Slurm prints it, the boundaries on both sides.
The same check against the real dev cluster: tests/test_slurm_launcher.py (bad input cases)."""

from __future__ import annotations

import pytest

from nexrl_hpc.launcher.cluster import Demand, Node, Partition, check_job, parse_sinfo, parse_time_limit

SINFO = """\
cpu*|c1|64|(null)|1-00:00:00
cpu*|c2|64|(null)|1-00:00:00
gpu|g1|96|gpu:a100:4(S:0-1)|2:00:00
gpu|g2|96|gpu:a100:4(S:0-1)|2:00:00
gpu|g3|48|gpu:v100:2,gpu:t4:1|2:00:00
debug|c1|64|(null)|30:00
debug|g1|96|gpu:a100:4(S:0-1)|30:00
long|c2|64+|(null)|infinite
"""


def test_sinfo_is_read_per_partition_with_gpus_and_limits() -> None:
    parts = parse_sinfo(SINFO)
    assert sorted(parts) == ["cpu", "debug", "gpu", "long"]
    assert [p.name for p in parts.values() if p.default] == ["cpu"]
    assert parts["gpu"].nodes == [Node("g1", 96, 4), Node("g2", 96, 4), Node("g3", 48, 3)]
    assert parts["debug"].nodes == [Node("c1", 64, 0), Node("g1", 96, 4)]
    assert parts["long"].nodes == [Node("c2", 64, 0)]
    assert [parts[p].max_time_min for p in ("cpu", "gpu", "debug", "long")] == [1440, 120, 30, None]


@pytest.mark.parametrize(
    ("limit", "minutes"),
    [("infinite", None), ("45", 45), ("30:00", 30), ("1:30:00", 90), ("2-01:00:30", 2940.5)],
)
def test_slurm_time_limits(limit: str, minutes: float | None) -> None:
    assert parse_time_limit(limit) == minutes


def check(
    part: Partition, demands: list[Demand], het: bool = False, time_min: float | None = None
) -> list[str]:
    problems = check_job(
        part,
        "launcher.partition",
        demands,
        separate_nodes=het,
        time_min=time_min,
        time_key="launcher.time_min",
        shrink_hint="use fewer ranks",
    )
    return [str(p) for p in problems]


def ranks(tasks: int, cpus: int = 1, gpus: int = 0, label: str = "trainer") -> Demand:
    return Demand(
        label,
        tasks,
        cpus,
        gpus,
        cpus_key=f"placement.resources.{label}.cpus_per_rank",
        gpus_key=f"placement.resources.{label}.gpus_per_rank",
    )


def test_a_job_fits_up_to_the_partitions_cpus_and_gpus_and_no_further() -> None:
    gpu = parse_sinfo(SINFO)["gpu"]  # 96+96+48 CPUs, 4+4+3 GPUs
    assert check(gpu, [ranks(240)]) == []
    assert check(gpu, [ranks(241)]) == [
        "launcher.partition: trainer needs 241 task(s) x 1 CPU(s), more than partition 'gpu' (2 node(s) of 96 "
        "CPUs + 4 GPUs, 1 node(s) of 48 CPUs + 3 GPUs) holds: use fewer ranks, or use a larger partition"
    ]
    assert check(gpu, [ranks(11, cpus=8, gpus=1)]) == []
    assert "needs 12 task(s) x 8 CPU(s) + 1 GPU" in check(gpu, [ranks(12, cpus=8, gpus=1)])[0]
    assert check(gpu, [ranks(2, cpus=8, gpus=4)]) == []  # the two a100 nodes
    assert "needs 3 task(s)" in check(gpu, [ranks(3, cpus=8, gpus=4)])[0]  # g3 has 3 GPUs


def test_one_rank_larger_than_every_node_names_its_resource_key() -> None:
    debug = parse_sinfo(SINFO)["debug"]
    assert check(debug, [ranks(1, cpus=97)]) == [
        "placement.resources.trainer.cpus_per_rank: trainer asks for 97 CPU(s) on one node; no node of "
        "partition 'debug' (1 node(s) of 96 CPUs + 4 GPUs, 1 node(s) of 64 CPUs) has more than 96"
    ]
    assert check(parse_sinfo(SINFO)["cpu"], [ranks(1, gpus=1)])[0].startswith(
        "placement.resources.trainer.gpus_per_rank: trainer asks for 1 GPU(s) on one node; no node of partition 'cpu'"
    )


def test_heterogeneous_components_need_nodes_of_their_own() -> None:
    two = Partition("dev", True, [Node("n1", 4, 0), Node("n2", 4, 0)], None)
    driver, rollout = ranks(2, label="driver"), ranks(4, label="rollout")
    assert check(two, [driver, rollout], het=True) == []
    assert check(two, [driver, rollout], het=False) == []
    third = ranks(1, label="extra")
    assert check(two, [driver, rollout, third], het=False) == []  # 7 tasks on 8 CPUs: one job fits
    assert check(two, [driver, rollout, third], het=True) == [
        "launcher.partition: a heterogeneous job gives each component nodes of its own: driver: 2 task(s) x 1 "
        "CPU(s) -> 1 node(s); rollout: 4 task(s) x 1 CPU(s) -> 1 node(s); extra: 1 task(s) x 1 CPU(s) -> 1 "
        "node(s); 3 nodes in all, but partition 'dev' (2 node(s) of 4 CPUs) has 2: use fewer ranks, or use a "
        "larger partition"
    ]
    gpu = parse_sinfo(SINFO)["gpu"]  # trainers on the two a100 nodes, rollouts on g3: fits
    assert check(gpu, [ranks(8, cpus=8, gpus=1), ranks(3, gpus=1, label="rollout")], het=True) == []
    with_driver = [ranks(1, label="driver"), ranks(8, cpus=8, gpus=1), ranks(3, gpus=1, label="rollout")]
    assert "driver: 1 task(s) x 1 CPU(s) -> 1 node(s)" in check(gpu, with_driver, het=True)[0]  # 4 nodes of 3
    refused = check(gpu, [ranks(9, cpus=8, gpus=1), ranks(3, gpus=1, label="rollout")], het=True)
    assert (
        "trainer: 9 task(s) x 8 CPU(s) + 1 GPU -> 3 node(s); rollout: 3 task(s) x 1 CPU(s) + 1 GPU -> 1"
        in refused[0]
    )
    assert "4 nodes in all" in refused[0]


def test_a_fixed_spread_needs_that_many_nodes_each_holding_its_tasks() -> None:
    gpu = parse_sinfo(SINFO)["gpu"]
    per_node = Demand("each node", 12, 8, tasks_per_node=4, gpus_per_node=3, cpus_key="c", gpus_key="g")
    assert check(gpu, [per_node]) == []
    per_node.gpus_per_node = 4  # g3 has 3: two nodes hold it, three are asked for
    assert "needs 12 task(s) x 8 CPU(s) (4 per node, 4 GPU(s))" in check(gpu, [per_node])[0]
    per_node.gpus_per_node = 5
    assert check(gpu, [per_node])[0].startswith("g: each node asks for 5 GPU(s) on one node")
    assert check(gpu, [Demand("each node", 2, 32, tasks_per_node=4, cpus_key="c")])[0].startswith(
        "c: each node asks for 128 CPU(s) on one node"
    )


def test_a_time_limit_above_the_partitions_is_refused() -> None:
    parts = parse_sinfo(SINFO)
    assert check(parts["debug"], [ranks(1)], time_min=30) == []
    assert check(parts["debug"], [ranks(1)], time_min=31) == [
        "launcher.time_min: 31 min is above the time limit of partition 'debug' (30 min): lower it (the run "
        "saves and requeues itself before the limit)"
    ]
    assert check(parts["long"], [ranks(1)], time_min=10**6) == []
