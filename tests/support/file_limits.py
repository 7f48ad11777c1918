"""A real write failure without a full disk: RLIMIT_FSIZE makes every write past the limit fail with EFBIG, the
error class a full disk (ENOSPC) or a quota (EDQUOT) gives the same writers."""

import resource
import signal
from contextlib import contextmanager


def limit_file_size(max_bytes: int):
    """From now on no file of this process may grow past `max_bytes` (SIGXFSZ ignored: the write fails instead of
    the process being killed); returns the function that lifts the limit."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, limits[1]))

    def lift():
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)

    return lift


@contextmanager
def file_size_limit(max_bytes: int):
    """limit_file_size inside the block."""
    lift = limit_file_size(max_bytes)
    try:
        yield
    finally:
        lift()
