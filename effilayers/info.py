"""``python -m effilayers.info [--demo] [--json]``: versions, devices and the
backend each op uses. The function form is ``effilayers.info()``.
``--kernels``: the GPU kernels compiled for sm_90 and sm_80 (``_kernel_report``)."""

import sys
import types

from ._info import info, main


class _CallableModule(types.ModuleType):
    """``import effilayers.info`` makes the import system bind this module to
    the package's ``info``, where the function was: calling the module calls
    the function, so ``effilayers.info()`` works either way."""

    def __call__(self, *args, **kwargs):
        return info(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
