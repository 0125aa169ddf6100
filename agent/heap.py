"""Giving freed C-heap memory back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

glibc keeps what threads free in per-thread arenas: ONNX Runtime's activations of an
instrumented run, or a burst of queued messages, would stay resident under everything that
comes after. Standard library only (the worker side runs on Python 3.6)."""


def trim_heap():
    # type: () -> None
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
