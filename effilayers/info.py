"""``python -m effilayers.info [--demo] [--json]``: versions, devices and the
backend each op uses. The function form is ``effilayers.info()``.
``--kernels``: the GPU kernels compiled for sm_90 and sm_80 (``_kernel_report``)."""

from ._info import main

if __name__ == "__main__":
    raise SystemExit(main())
