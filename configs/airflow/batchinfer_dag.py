"""Airflow DAG: runs a batchinfer job once a day into a dated output prefix.

Copy into your DAGs folder and set the Airflow Variables `batchinfer_config` (a spec path on
the worker) and `batchinfer_output_prefix` (e.g. s3://bucket/labels). A retried task resumes
the same dated output: committed shards are not redone.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

with DAG(
    dag_id="batchinfer_daily",
    description="Daily batch inference with batchinfer (resumes on retry)",
    schedule="@daily",
    start_date=datetime(2026, 11, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=10)},
    tags=["batchinfer"],
) as dag:
    BashOperator(
        task_id="run_batchinfer",
        # The same command as jobs.schedule.job_command(config, prefix, ds).
        bash_command=(
            "python -m jobs.run {{ var.value.batchinfer_config }} "
            "--set output.path={{ var.value.batchinfer_output_prefix.rstrip('/') }}/{{ ds }}/"
        ),
        execution_timeout=timedelta(hours=12),
    )
