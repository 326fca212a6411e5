"""Scheduled runs: the rendered command, the cron script end to end, the Airflow DAG."""
from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from helpers import write_jsonl
from jobs.exit_codes import EXIT_CODES
from jobs.schedule import dated_output, job_command

ROOT = Path(__file__).resolve().parents[2]


def test_dated_output_and_command():
    assert dated_output("s3://bucket/labels/", "2026-11-30") == "s3://bucket/labels/2026-11-30/"
    cmd = job_command("configs/s3_io.yaml", "s3://bucket/labels", "2026-11-30", extra=["--set", "workers.num=4"])
    assert cmd == ("python -m jobs.run configs/s3_io.yaml --set output.path=s3://bucket/labels/2026-11-30/ "
                   "--set workers.num=4")
    assert set(EXIT_CODES) == {0, 1, 2, 3}


def test_airflow_dag_renders_the_same_command():
    """The DAG's bash_command template, rendered the way Airflow renders it, is job_command()."""
    jinja2 = pytest.importorskip("jinja2")
    source = (ROOT / "configs" / "airflow" / "batchinfer_dag.py").read_text()
    tree = ast.parse(source)
    template = next(ast.literal_eval(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                    for kw in node.keywords if kw.arg == "bash_command")
    variables = {"batchinfer_config": "configs/s3_io.yaml", "batchinfer_output_prefix": "s3://bucket/labels/"}
    rendered = jinja2.Template(template).render(ds="2026-11-30", var={"value": variables})
    assert rendered == job_command("configs/s3_io.yaml", "s3://bucket/labels/", "2026-11-30")


@pytest.mark.slow
def test_cron_script_runs_into_a_dated_prefix_and_passes_exit_codes_through(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"cron {i}"} for i in range(5)])
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: builtin:tiny\ninput: {{path: {tmp_path / 'in.jsonl'}}}\noutput: {{path: unused/}}\n"
                    "sampling: {max_tokens: 3}\n")
    script = ROOT / "scripts" / "cron_example.sh"
    done = subprocess.run(["bash", str(script), str(spec), str(tmp_path / "daily"), "2026-11-30"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((tmp_path / "daily" / "2026-11-30" / "manifest.json").read_text())
    assert manifest["rows"] == 5
    again = subprocess.run(["bash", str(script), str(spec), str(tmp_path / "daily"), "2026-11-30"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    spec.write_text("input: {path: x.jsonl}\noutput: {path: o/}\nbogus: 1\n")
    bad = subprocess.run(["bash", str(script), str(spec), str(tmp_path / "daily")], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "bogus: unknown key" in bad.stderr


@pytest.mark.slow
def test_the_dag_loads_in_real_airflow(tmp_path):
    """DagBag in the Airflow of .venv-airflow (made by scripts/setup_airflow.sh): no import errors."""
    python = ROOT / ".venv-airflow" / "bin" / "python"
    assert python.exists(), "run scripts/setup_airflow.sh (scripts/test.sh does)"
    code = """
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder="configs/airflow")
dag = bag.dags.get("batchinfer_daily")
task = dag.get_task("run_batchinfer") if dag else None
print(json.dumps({"errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": sorted(bag.dag_ids),
                  "command": task.bash_command if task else None, "retries": task.retries if task else None}))
"""
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"AIRFLOW_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == {} and result["dags"] == ["batchinfer_daily"]
    assert "python -m jobs.run" in result["command"] and "{{ ds }}" in result["command"]
    assert result["retries"] == 3
