"""raytrain-mgpu: multi-GPU training of PyTorch models on Ray, behind one API.

    import raytrain_mgpu as rtm
    result = rtm.fit(rtm.TrainConfig(model="lenet", dataset="digits", num_workers=2))
    model = result.load_model()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain_mgpu.api import TrainResult, compare, fit
    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.data import Datasets

__all__ = ["TrainConfig", "TrainResult", "fit", "compare", "Datasets"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # PEP 562: the public names load on first use, so `import raytrain_mgpu` (and the CLI's
    # --help, which imports the package first) costs no import of torch (~3 s) or Ray (~3 s).
    if name == "TrainConfig":
        # late: the config package and the registries it checks names against (0.06 s of import; the package
        # alone takes 0.006 s) load when a config is made
        from raytrain_mgpu.config.train import TrainConfig

        return TrainConfig
    if name in ("fit", "TrainResult", "compare"):
        from raytrain_mgpu import api  # late: torch and Ray (2.6 s of import) load for a run

        return getattr(api, name)
    if name == "Datasets":
        from raytrain_mgpu.data.base import Datasets  # late: torch (2.4 s of import)

        return Datasets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
