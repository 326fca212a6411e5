"""What a job reports: progress while it runs, counts and costs over committed shards, and what a
complete job writes last (metrics.json, OpenAI Batch files, manifest.json)."""
