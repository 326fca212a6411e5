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
