"""The compiled modules. They are listed here rather than in pyproject.toml because the
live drain's include path is pyzmq's, asked of the installed pyzmq at build time.

Each is optional: a machine without a C compiler (the slim image) still installs kvroute,
on the pure paths (``kvroute.index.IMPLEMENTATION`` then says "pure"). The live drain also
needs libzmq's header (``zmq.h``, Debian's libzmq3-dev) for the layout of pyzmq's ``Frame``;
without it that one module is left out and live messages go by the Python path.
"""

import zmq
from setuptools import Extension, setup

setup(ext_modules=[
    # The prefix index's loops (with index/_tables.pxi, _batch.pxi, _keys.pxi).
    Extension("kvroute.index._fast", ["index/_fast.pyx"], optional=True),
    # The route body's token-id reader.
    Extension("kvroute.app.api._token_scan", ["app/api/_token_scan.pyx"], optional=True),
    # A subscriber's compiled take of live messages, through pyzmq's Cython API.
    Extension("kvroute.app.ingest._live_drain", ["app/ingest/_live_drain.pyx"],
              include_dirs=zmq.get_includes(), optional=True),
])
