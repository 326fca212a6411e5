#!/usr/bin/env bash
# Idempotent: a separate .venv-airflow/ with Apache Airflow, used only to check that the example
# DAG (configs/airflow/) loads in a real Airflow. Kept apart so Airflow's pins never touch .venv/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
spec="${AIRFLOW_SPEC:-apache-airflow==3.3.2}"
stamp=".venv-airflow/.batchinfer-setup"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ]; then
    exit 0
fi
echo "[setup] creating .venv-airflow with $spec (for the DAG test)"
"${PYTHON:-python3}" -m venv .venv-airflow
.venv-airflow/bin/python -m pip --disable-pip-version-check -q install "$spec" 2>&1 | grep -v "^WARNING: Location" || true
.venv-airflow/bin/python -c "import airflow" && printf '%s' "$spec" > "$stamp"
