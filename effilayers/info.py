"""``python -m effilayers.info [--demo] [--json]``: versions, devices and the
backend each op uses. The function form is ``effilayers.info()``."""

from ._info import main

if __name__ == "__main__":
    raise SystemExit(main())
