#!/usr/bin/env bash
# Cron entry point: runs a job spec into a dated output prefix, once per day.
#
#   # crontab -e    (every day at 02:00; a rerun the same day resumes the same output)
#   0 2 * * * /opt/batchinfer/scripts/cron_example.sh configs/s3_io.yaml s3://bucket/daily >> /var/log/batchinfer.log 2>&1
#
# Exit codes: 0 done or nothing to do, 1 failed (rerun resumes), 2 bad spec, 3 error rate too high.
# Two overlapping runs of the same day never write at once: the second exits 1 on the run lock.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="${1:?usage: cron_example.sh CONFIG OUTPUT_PREFIX [DATE]}"
prefix="${2:?usage: cron_example.sh CONFIG OUTPUT_PREFIX [DATE]}"
ds="${3:-$(date -u +%Y-%m-%d)}"
cd "$root"
[ -x .venv/bin/python ] || bash scripts/setup.sh
echo "[$(date -u +%FT%TZ)] batchinfer $config -> ${prefix%/}/$ds/"
set +e
.venv/bin/python -m jobs.run "$config" --set "output.path=${prefix%/}/$ds/"
code=$?
set -e
echo "[$(date -u +%FT%TZ)] exit $code"
exit "$code"
