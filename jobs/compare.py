"""Entry point for `ray job submit`: the same options as `raytrain-mgpu compare`.

    ray job submit --working-dir . -- python jobs/compare.py --model resnet18 --dataset fashion_mnist \
        --data-root /data/fmnist --use-gpu --memory-budget-bytes 70GiB

Runs the model under every strategy the cluster can hold (or --strategies ddp fsdp ...),
prints the table and the recommendation, and writes compare.md, compare.parquet and
compare.png under <storage-path>/compare-<time>/ (or --out-dir). Exits non-zero on error.
"""

import sys

from raytrain_mgpu.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
