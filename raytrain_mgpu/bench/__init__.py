"""Benchmarks, outside the training path: nothing in training imports this package.

- ``ddp.py``               ``fit`` vs a plain loop, torchrun and a hand-written Ray Train loop;
- ``_torchrun_ddp.py``     the torchrun baseline's ranks;
- ``step_scalars.py``      ``bench --step-scalars``: fit with per-step scalars every step, at the default N, off;
- ``pipeline.py``          the pipeline benchmark (efficiency, torchrun + pipelining, naive mp);
- ``_torchrun_pipeline.py`` its torchrun + ``torch.distributed.pipelining`` ranks;
- ``checkpoint.py``        ``bench-checkpoint``: the training stall per checkpoint, synchronous vs asynchronous upload;
- ``preemption.py``        ``bench-preemption``: what the preemption check costs against a small DDP step;
- ``tensor_parallel.py``   ``bench-tensor-parallel``: fsdp with and without tensor groups on local gloo ranks;
- ``gpu_report.py``        ``raytrain-mgpu gpu-report``: every GPU figure of docs/performance.md;
- ``gpu_bench.py``         ``bench-gpu``: samples/s and MFU of a plain loop, ``fit`` and Lightning on one GPU
  (ResNet-18 at CIFAR size, a transformer LM; fp32 and bf16);
- ``_gpu_bench_runners.py`` its three runners and its in-memory data;
- ``lm.py``                ``bench-lm``: LoRA on a small Llama from a Hugging Face folder, tokens/s and MFU of ``fit``
  on 1 and 2 workers against a plain transformers + peft loop;
- ``_lm_materials.py``     its model folder, tokenizer and text, made with no network.
"""


def start_local_ray() -> bool:
    """A local Ray for the runs on Ray Train's workers (emulated GPUs where set), unless one is connected; True if
    started here, for the caller to shut down."""
    import ray

    from raytrain_mgpu.engine import devices

    if ray.is_initialized():
        return False
    ray.init(log_to_driver=False, **devices.local_ray_init_kwargs())
    return True
