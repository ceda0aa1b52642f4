from .gpu import *  # noqa: F403  (temporary: the GPU renderer moved to eclat.backends.gpu)
from .gpu import __all__  # noqa: F401
