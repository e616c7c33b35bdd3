"""Functional forms of effilayers ops (``import effilayers.functional as EF``).

Each op family names the functions it exports here in its ``op.py``
(``FUNCTIONAL``); the families are found on disk (``_core/families.py``), so
a new family is exported by being there.
"""

from ._core.families import family_exports

_exports = family_exports("op", "FUNCTIONAL")
# reductions' sum/mean/... shadow the builtins inside this module, which uses none of them
globals().update(_exports)
__all__: list[str] = list(_exports)
del _exports
