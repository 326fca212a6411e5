"""engine.device auto with workers.gpus unset: a job's actors ask for one GPU per tensor-parallel
rank where the Ray cluster has GPUs, run on CPU (gloo) where it has none, and a cluster whose
nodes hold fewer GPUs than the ranks fails at once in one line. The cluster with GPUs is a fake
one: a local Ray started with num_gpus=2 on this CPU machine, in its own process."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from pipeline.run.shards.devices import choose_devices
from pipeline.spec import validate

BASE = {"model": "builtin:tiny", "input": {"path": "in.jsonl"}, "output": {"path": "out/"}}
CPU_NODE = {"CPU": 16.0}
GPU_NODE = {"CPU": 16.0, "GPU": 8.0}


def spec(tp: int = 1, **workers):
    return validate({**BASE, "engine": {"tensor_parallel_size": tp}, "workers": workers})


def test_the_choice_follows_the_cluster_and_the_spec():
    on_gpus = choose_devices(spec(4), [CPU_NODE, GPU_NODE], [])
    assert on_gpus.gpus == 4 and on_gpus.resolved
    assert on_gpus.line.startswith("devices: the Ray cluster has GPUs: each engine actor asks for 4 GPUs, one per")
    cpu = choose_devices(spec(2), [CPU_NODE], [])
    assert cpu.gpus == 0 and "2 tensor-parallel ranks on CPU over gloo" in cpu.line
    assert choose_devices(spec(2), [CPU_NODE], [GPU_NODE]).gpus == 2  # an autoscaler may add a GPU node
    kept = choose_devices(spec(2), [GPU_NODE], [], keep_cpu=True)
    assert kept.gpus == 0 and "generated on CPU" in kept.line
    explicit = choose_devices(spec(2, gpus=0), [GPU_NODE], [])
    assert explicit.gpus == 0 and not explicit.resolved and explicit.line == "devices: CPU (engine.device auto, workers.gpus 0)"
    cuda = validate({**BASE, "engine": {"device": "cuda", "tensor_parallel_size": 2}})
    assert choose_devices(cuda, [CPU_NODE], []).gpus == 2  # check_gpus set it: the spec decides
    one = choose_devices(spec(1), [GPU_NODE], [])
    assert one.gpus == 1 and one.line.startswith("devices: the Ray cluster has GPUs: each engine actor asks for 1 GPU (")


FAKE_CLUSTER = textwrap.dedent("""
    import json, sys
    import ray
    from pipeline.errors import JobError
    from pipeline.run import engine_stage_args, run_job
    from pipeline.run.shards.devices import resolve_devices
    from pipeline.spec import Job, validate

    ray.init(address="local", num_cpus=1, num_gpus=2, include_dashboard=False, logging_level="WARNING")
    tmp = sys.argv[1]
    open(f"{tmp}/in.jsonl", "w").write('{"prompt": "x"}\\n')
    def spec(tp, out):
        return validate({"model": "builtin:tiny", "engine": {"tensor_parallel_size": tp},
                         "input": {"path": f"{tmp}/in.jsonl"}, "output": {"path": f"{tmp}/{out}"}})
    report = {}
    s = spec(2, "a")
    choice = resolve_devices(s)
    report["gpus"] = s.workers.gpus
    report["num_gpus"] = engine_stage_args(s.workers)["num_gpus"]
    report["numerics"] = s.numerics()

    class Seen(Exception):
        pass
    lines = []
    def progress(line):
        lines.append(line)
        if line.startswith("devices:"):
            raise Seen()  # the job would start its actors next: on this machine they have no CUDA
    try:
        run_job(Job.of(spec(2, "b")), progress=progress)
    except Seen:
        pass
    report["line"] = lines[-1]
    try:
        run_job(Job.of(spec(4, "c")), progress=lambda line: None)
    except JobError as exc:
        report["error"] = str(exc)
    print("REPORT " + json.dumps(report))
""")


def test_a_fake_two_gpu_cluster_gives_each_actor_its_ranks_gpus(tmp_path):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", FAKE_CLUSTER, str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=240)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(line[len("REPORT "):])
    assert report["gpus"] == 2 and report["num_gpus"] == 2
    assert report["numerics"] == {"device": "cuda", "dtype": "bfloat16"}
    assert report["line"] == ("devices: the Ray cluster has GPUs: each engine actor asks for 2 GPUs, one per "
                              "tensor-parallel rank (engine.device auto; set workers.gpus: 0 to run on CPU)")
    assert report["error"] == ("engine.tensor_parallel_size 4 on GPUs (engine.device auto): no node of the Ray "
                               "cluster has 4 GPU for one engine actor (most on one node: 2); lower it, or use a "
                               "cluster that has such nodes")


def test_the_output_records_the_choice_and_a_resume_keeps_it(tmp_path, monkeypatch):
    import pytest

    from pipeline.errors import OutputConflict
    from pipeline.io import OutputDir, Storage
    from pipeline.run.shards import devices
    from pipeline.run.checks.claim import choose_devices, claim
    from pipeline.spec import Job

    def job(out: str) -> Job:
        return Job.of(validate({**BASE, "output": {"path": str(tmp_path / out)}}))

    def cluster(*nodes):
        monkeypatch.setattr(devices, "alive_nodes", lambda ray: list(nodes))
        monkeypatch.setattr(devices, "node_groups", lambda: [])

    lines = []
    cluster(GPU_NODE)
    fresh, out = job("fresh"), OutputDir(Storage(str(tmp_path / "fresh")), "parquet")
    claim(out, fresh, False, {})
    assert choose_devices(fresh, out, lines.append) and fresh.spec.workers.gpus == 1
    assert out.read_json("_job.json")["numerics"] == {"device": "cuda", "dtype": "bfloat16"}
    again = job("fresh")  # its resume, on the same cluster: the claim leaves the check to the choice
    claim(out, again, False, {})
    assert choose_devices(again, out, lines.append)

    started, out = job("cpu"), OutputDir(Storage(str(tmp_path / "cpu")), "parquet")
    claim(out, started, False, {})  # generated on CPU ...
    out.storage.fs.makedirs(out.storage.path("data"), exist_ok=True)  # ... with rows committed
    assert not choose_devices(started, out, lines.append) and started.spec.workers.gpus == 0
    assert "generated on CPU: its resume stays on CPU" in lines[-1]

    cluster(CPU_NODE)  # the GPU output resumed where no GPU is left: refused in one line
    with pytest.raises(OutputConflict, match="was generated in bfloat16 on cuda, and this run would compute in float32"):
        gone = job("fresh")
        out = OutputDir(Storage(str(tmp_path / "fresh")), "parquet")
        out.storage.fs.makedirs(out.storage.path("data"), exist_ok=True)
        claim(out, gone, False, {})
        choose_devices(gone, out, lines.append)
