"""Functional forms of effilayers ops (``import effilayers.functional as EF``).

Each op family names the functions it exports here in its ``op.py``
(``FUNCTIONAL``); the families are found on disk (``_core/families.py``), so
a new family is exported by being there.
"""

from ._core.families import family_modules

__all__: list[str] = []
for _op in family_modules("op"):
    # reductions' sum/mean/... shadow the builtins inside this module, which uses none of them
    globals().update({name: getattr(_op, name) for name in getattr(_op, "FUNCTIONAL", ())})
    __all__ += getattr(_op, "FUNCTIONAL", ())
del _op
