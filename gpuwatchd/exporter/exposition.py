"""One cycle's exposition in one format, as ``/metrics`` serves it: the body, its gzip and the
``name[]`` filter, all answered from one rendering (exporter/render.py) that the registry keeps
until the state or a counter changes (exporter/collector.py).

gzip is compressed at level 1 on the first request that asks for it and kept beside the body (at
64 ranks 119 kB -> 13 kB for about 0.3 ms once per cycle; level 9, client_python's, costs about
ten times that for 4 % less). A ``name[]`` filter picks families out of the rendering (a few
string joins, at most the body's size), so no request renders anew, whatever it asks
(docs/security.md, N6). Cost: the body, its gzip once asked for, and the rendering's family
strings (shared with the renderer's ``Prefixes``). Privilege: none. Shell equivalent:
``curl -H 'Accept-Encoding: gzip' 'http://node:9958/metrics?name[]=gpuwatch_rank_up'``.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable

from gpuwatchd.exporter.render import Part, join, select

GZIP_LEVEL = 1


class Exposition:
    def __init__(self, parts: list[Part], openmetrics: bool) -> None:
        self.parts = parts
        self.openmetrics = openmetrics
        self.body = join(parts, openmetrics)
        self._gzip: bytes | None = None
        self._lock = threading.Lock()

    def gzipped(self) -> bytes:
        """The body as a gzip member (mtime 0, so the same body compresses to the same bytes)."""
        with self._lock:
            if self._gzip is None:
                z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: the gzip container
                self._gzip = z.compress(self.body) + z.flush()
            return self._gzip

    def select(self, names: Iterable[str]) -> bytes:
        """client_python's ``name[]`` answer (``restricted_registry``), from this rendering."""
        return select(self.parts, names, self.openmetrics)
