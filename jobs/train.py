"""Entry point for `ray job submit`: the same options as `raytrain-mgpu train`.

    ray job submit --working-dir . -- python jobs/train.py --config jobs/configs/digits.yaml --epochs 5

Inside a job, Ray sets RAY_ADDRESS, so `fit` joins the cluster instead of starting one.
Exits non-zero with the error on failure.
"""

import sys

from raytrain_mgpu.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
