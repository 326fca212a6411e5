"""Running a job's shards: planning them from the input files (Ray tasks), the Ray Data dataflow,
the engine actors that generate and commit whole shards, what each actor asks Ray for and on
which devices, the unique-id check beside the work, Ray itself, and the fault-injection points."""
