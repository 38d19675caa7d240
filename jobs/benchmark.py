"""Data-parallel benchmark for `ray job submit` or a shell: see raytrain_mgpu/bench/ddp.py.

    python jobs/benchmark.py [--num-samples N] [--epochs E] [--rounds R]
"""

import sys

from raytrain_mgpu.bench.ddp import main

if __name__ == "__main__":
    sys.exit(main())
