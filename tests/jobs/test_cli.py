from click.testing import CliRunner

from engine import __version__
from jobs.cli import main


def test_version_and_help():
    runner = CliRunner()
    out = runner.invoke(main, ["--version"])
    assert out.exit_code == 0 and __version__ in out.output
    out = runner.invoke(main, ["--help"])
    assert out.exit_code == 0 and "batch inference" in out.output


def test_the_report_names_each_ranks_weights_and_load_peak():
    from jobs.cli import report_table

    mib = 2**20
    engine = {"device": "cpu", "dtype": "float32", "quantization": "int8", "tensor_parallel_size": 2,
              "weights_bytes": 12 * mib, "kv_blocks": 64, "kv_bytes": 4 * mib, "max_num_batched_tokens": 1024,
              "shards": 3, "rank_weights_bytes": [12 * mib, 9 * mib], "rank_load_peak_bytes": [13 * mib, 10 * mib]}
    data = {"output": "out", "status": "complete", "shards_committed": 3, "rows": 30, "errors": 0,
            "prompt_tokens": 300, "generated_tokens": 90, "engines": [engine, {**engine, "tensor_parallel_size": 1,
                                                                                "rank_weights_bytes": None,
                                                                                "rank_load_peak_bytes": None}]}
    lines = report_table(data).splitlines()
    assert "ranks' weights 12.0 MiB / 9.0 MiB, load peaks 13.0 MiB / 10.0 MiB" in lines[-2]
    assert sum("ranks' weights" in line for line in lines) == 1
