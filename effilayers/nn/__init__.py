"""``nn.Module`` drop-ins: each op family's modules (``ops/<family>/module.py``,
its ``__all__``; the families are found on disk by ``_core/families.py``) and
:class:`MaxPool2d`, which needs no op of its own."""

from .._core.families import family_modules
from .pooling import MaxPool2d as MaxPool2d

__all__: list[str] = []
for _module in family_modules("module"):
    globals().update({name: getattr(_module, name) for name in _module.__all__})
    __all__ += _module.__all__
__all__.append("MaxPool2d")
del _module
