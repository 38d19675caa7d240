"""What a sharded (fsdp) checkpoint stalls training, DCP's synchronous save against its asynchronous one, for
`ray job submit` or a shell on a machine with a GPU:

    python jobs/fsdp_checkpoint_stall.py [--layers 12] [--hidden 768] [--steps 120] [--every 20]

Two fits of the same transformer LM (one worker, bf16, a step checkpoint every ``--every`` steps), the second with
``RAYTRAIN_MGPU_ASYNC_SHARDED_SAVE=1``; printed: each run's time in checkpoints and in steps, and their ratio.
"""

import argparse
import io
import os
import sys

import raytrain_mgpu as rtm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--storage-path", default="/tmp/fsdp-checkpoint-stall")
    args = parser.parse_args(argv)
    seconds = {}
    for mode in ("sync", "async"):
        os.environ["RAYTRAIN_MGPU_ASYNC_SHARDED_SAVE"] = "1" if mode == "async" else "0"
        cfg = rtm.TrainConfig(model="transformer_lm", model_kwargs={"num_layers": args.layers, "hidden": args.hidden,
                                                                    "num_heads": max(1, args.hidden // 64)},
                              dataset="synthetic_text", input_shape=[256], num_classes=8192,
                              num_samples=32 * args.steps, batch_size=32, strategy="fsdp", num_workers=1,
                              use_gpu=True, runner="ray", epochs=1, checkpoint_every_n_steps=args.every,
                              precision="bf16-mixed", storage_path=args.storage_path, name=f"stall-{mode}")
        row = rtm.fit(cfg, stream=io.StringIO()).history[-1]
        seconds[mode] = row["checkpoint_s"]
        print(f"{mode:>5}: {row['checkpoint_s']:.2f} s in checkpoints, {row['training_s']:.2f} s in steps")
    print(f"async / sync: {seconds['async'] / seconds['sync']:.2f}x the time in checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
