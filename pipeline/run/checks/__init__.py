"""Before a job's engines start: what dooms every actor (preflight), the job's LoRA adapters read
and checked, and whether the output directory accepts this job (claim, against its JobRecord)."""
