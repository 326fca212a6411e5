"""Fault injection for the chaos scenarios: the faults behind pipeline.run.shards.chaos's hook
(`faults`), a throttling S3 proxy (`proxy`), and the scenarios themselves (`harness`,
run by scripts/chaos.sh and tests/jobs/test_chaos.py). Importable with tests/ on the path."""
