"""`python -m jobs.run CONFIG [...]`: the `batchinfer run` command, for `ray job submit`."""
from jobs.cli import run

if __name__ == "__main__":
    run(prog_name="python -m jobs.run")
