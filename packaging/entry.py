"""Entry point of the frozen Thermocline bundle (PyInstaller runs this as `__main__`).

Same as the `thermocline` console script (`app.cli:main`), plus one packaging hook:
with THERMOCLINE_PREPARE_KERNELS=1 it compiles the numba CPU kernels into their on-disk
cache and exits. The Linux package's postinst and the Windows installer run it once after
installing, on the user's own CPU, so the first launch does not spend ~30 s compiling.
"""

import multiprocessing
import os
import sys


def _prepare_kernels() -> int:
    from engine.kernels import cpu

    info = cpu.warmup()
    print(f"thermocline: CPU kernels ready in {info['seconds']:.1f} s "
          f"(compiled {info['compiled']}, from cache {info['cache_hits']}, numba {info['numba']})")
    return 0


if __name__ == "__main__":
    multiprocessing.freeze_support()
    if os.environ.get("THERMOCLINE_PREPARE_KERNELS", "") == "1":
        sys.exit(_prepare_kernels())
    from app.cli import main

    sys.exit(main())
