"""``nn.Module`` drop-ins: each op family's modules (``ops/<family>/module.py``,
its ``__all__``; the families are found on disk by ``_core/families.py``) and
:class:`MaxPool2d`, which needs no op of its own."""

from .._core.families import family_exports
from .pooling import MaxPool2d as MaxPool2d

_exports = family_exports("module", "__all__")
globals().update(_exports)
__all__: list[str] = [*_exports, "MaxPool2d"]
del _exports
