"""Unmodified pynvml (the nvidia-ml-py package) sees the slice, not the card.

usage: t_pynvml.py LIMIT_MIB USED_MIB [NVML_INDEX]
       (shim preloaded, fake libnvidia-ml.so.1 on LD_LIBRARY_PATH; the card at NVML_INDEX,
       default 0, must show LIMIT_MIB and USED_MIB)
"""

import sys

MiB = 1 << 20

try:
    import pynvml
except ImportError:
    print(
        f"FAIL t_pynvml: nvidia-ml-py (module pynvml) is not installed for {sys.executable}; "
        "install it (pip install nvidia-ml-py) or run make -C shim check PYTHON=/path/to/python",
        file=sys.stderr,
    )
    sys.exit(1)


def fail(msg):
    print(f"FAIL t_pynvml: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    limit, used = int(sys.argv[1]) * MiB, int(sys.argv[2]) * MiB
    index = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    m = pynvml.nvmlDeviceGetMemoryInfo(handle)
    if (m.total, m.used, m.free) != (limit, used, limit - used):
        fail(f"v1 total/used/free {m.total}/{m.used}/{m.free}, want {limit}/{used}/{limit - used}")
    m2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    if (m2.total, m2.used, m2.free) != (limit, used, limit - used):
        fail(
            f"v2 total/used/free {m2.total}/{m2.used}/{m2.free}, want {limit}/{used}/{limit - used}"
        )
    pynvml.nvmlShutdown()
    print(f"pynvml {pynvml.__file__}: total {m.total >> 20} MiB, used {m.used >> 20} MiB")


main()
