"""The job object the pipeline passes around: typed, picklable, and built from the older spec dict."""
import pickle

from pipeline.spec import Job, validate

SPEC = {"input": {"path": "in.jsonl", "few_shot": [{"user": "q", "assistant": "a"}]}, "output": {"path": "out/"},
        "sampling": {"max_tokens": 5}, "workers": {"num": 2}}


def test_a_job_carries_its_spec_and_fingerprint_and_survives_pickling():
    job = Job.of(validate(SPEC))
    assert job.fingerprint == job.spec.fingerprint() and job.created is None
    assert job.spec.workers.num == 2 and job.spec.sampling.max_tokens == 5
    again = pickle.loads(pickle.dumps(job))
    assert again == job and again.spec.input.few_shot[0].user == "q"


def test_the_spec_dict_older_callers_pass_gives_the_same_job():
    spec = validate(SPEC)
    data = spec.model_dump(mode="json") | {"fingerprint": spec.fingerprint()}
    assert Job.from_dict(data) == Job.of(spec)
    assert Job.from_dict(data | {"fingerprint": "kept"}).fingerprint == "kept"


def test_an_output_resumes_only_in_the_numerics_it_was_generated_in(tmp_path):
    """workers.gpus is no part of the fingerprint, yet with engine.device and dtype auto it moves
    the engines from float32 on CPU to bfloat16 on CUDA, which gives other rows: the output
    records what it was generated in, and a resume that would compute otherwise is refused in
    one line saying how to resume it. An output from before the record resumes as it did."""
    import pytest

    from pipeline.errors import OutputConflict
    from pipeline.io import OutputDir, Storage
    from pipeline.run.checks.claim import claim

    def job(**workers):
        return Job.of(validate({"input": {"path": "-"}, "output": {"path": str(tmp_path / "out")},
                                "workers": workers}))

    cpu, gpu = job(), job(gpus=1)
    assert cpu.fingerprint == gpu.fingerprint
    assert cpu.spec.numerics() == {"device": "cpu", "dtype": "float32"}
    assert gpu.spec.numerics() == {"device": "cuda", "dtype": "bfloat16"}
    out = OutputDir(Storage(str(tmp_path / "out")), "parquet")
    assert claim(out, cpu, False, {}).numerics == cpu.spec.numerics()
    assert claim(out, job(gpus=0), False, {})  # the same numerics resume
    with pytest.raises(OutputConflict) as err:
        claim(out, gpu, False, {})
    message = str(err.value)
    assert "float32 on cpu" in message and "bfloat16 on cuda" in message and "workers.gpus 0" in message
    assert "\n" not in message
    out.mark_success()  # a complete output is not resumed: the rerun has nothing to do, whatever it would compute in
    assert claim(out, gpu, False, {})
    out.storage.fs.rm(out.storage.path("_SUCCESS"))
    record = out.read_json("_job.json")
    del record["numerics"]  # as written before outputs recorded them
    out.write_json("_job.json", record)
    assert claim(out, gpu, False, {})
