"""The actors' resource request against the cluster's nodes (pure logic, no Ray)."""
from pipeline.run.shards.resources import actor_request, describe, scalable, shortfall
from pipeline.spec import WorkersSpec

CPU_NODE = {"CPU": 2.0, "memory": 8e9}
GPU_NODE = {"CPU": 8.0, "GPU": 1.0}


def test_an_actor_fits_when_one_node_holds_all_it_asks_for():
    need = actor_request(WorkersSpec(cpus=1, gpus=1))
    assert need == {"CPU": 1.0, "GPU": 1.0}
    assert shortfall(need, [CPU_NODE, GPU_NODE]) is None
    assert shortfall(actor_request(WorkersSpec(cpus=0.5, gpus=0)), [CPU_NODE]) is None


def test_the_missing_resource_is_named_with_the_most_any_node_has():
    need = actor_request(WorkersSpec(cpus=0.5, gpus=1))
    assert shortfall(need, [CPU_NODE, CPU_NODE]) == ("GPU", 0.0)
    assert describe(need, ("GPU", 0.0)) == (
        "workers.gpus=1: no node of the Ray cluster has 1 GPU for one engine actor (most on one node: 0)")
    assert shortfall(actor_request(WorkersSpec(cpus=16, gpus=1)), [CPU_NODE, GPU_NODE]) == ("CPU", 8.0)
    # enough CPU on one node and a GPU on another is not enough for one actor
    split = [{"CPU": 16.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert shortfall(actor_request(WorkersSpec(cpus=4, gpus=1)), split) is not None


def test_an_autoscaler_helps_only_with_a_node_type_that_fits():
    need = actor_request(WorkersSpec(cpus=4, gpus=2))
    assert scalable(need, [CPU_NODE, GPU_NODE]) is False
    assert scalable(need, [{"CPU": 8.0, "GPU": 4.0}]) is True
    assert scalable(need, []) is False


def test_a_tensor_parallel_actor_asks_for_one_gpu_per_rank_of_one_node():
    from pipeline.spec import JobSpec

    spec = JobSpec(input={"path": "-"}, output={"path": "-"}, engine={"tensor_parallel_size": 2, "device": "cuda"})
    need = actor_request(spec.workers)
    assert need["GPU"] == 2.0
    assert shortfall(need, [GPU_NODE, GPU_NODE]) == ("GPU", 1.0)  # two 1-GPU nodes do not hold one actor
    assert describe(need, ("GPU", 1.0)) == (
        "workers.gpus=2: no node of the Ray cluster has 2 GPU for one engine actor (most on one node: 1)")
