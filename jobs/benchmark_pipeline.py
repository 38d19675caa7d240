"""Pipeline benchmark: efficiency vs the ideal, vs torchrun + torch.distributed.pipelining,
and vs naive model parallelism, printed side by side.

    python jobs/benchmark_pipeline.py                 # P=2, m=8, MLP 8 x 1024, 128-row micro-batches
    python jobs/benchmark_pipeline.py --rows 256 --json figures.json
"""

import json
import logging

from raytrain_mgpu.bench.pipeline import format_report, parse_args, run_benchmark

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    bench, json_path = parse_args()
    results = run_benchmark(bench)  # starts Ray here if needed, and stops it
    print(format_report(results))
    if json_path:
        with open(json_path, "w") as out:
            json.dump(results, out, indent=1)
