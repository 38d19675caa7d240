"""raytrain-mgpu: multi-GPU training of PyTorch models on Ray, behind one API.

    import raytrain_mgpu as rtm
    result = rtm.fit(rtm.TrainConfig(model="lenet", dataset="digits", num_workers=2))
    model = result.load_model()
"""

from raytrain_mgpu.api import TrainResult, fit
from raytrain_mgpu.planning.compare import compare
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.data import Datasets

__all__ = ["TrainConfig", "TrainResult", "fit", "compare", "Datasets"]
__version__ = "0.1.0"
