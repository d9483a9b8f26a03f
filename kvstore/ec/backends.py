"""The two ways to run ISA-L's Reed-Solomon over fragments: direct (ctypes) and through pyeclib.

Both come from one ``pip install pyeclib``: its x86-64 wheel bundles ISA-L as
``pyeclib.libs/libisal-pyeclib.so.*``.

- ``IsalBackend`` calls that library's ``ec_init_tables``/``ec_encode_data`` through ctypes on
  fragments that already sit inside our shard buffers. pyeclib's own API copies the payload in,
  adds its 80-byte fragment headers and allocates fresh aligned buffers per call; measured here
  that costs 2-20x at the sizes we store (at 1.35 MiB pyeclib encode dropped to ~0.6 GB/s from
  page faults on its fresh buffers, while ISA-L itself runs at > 10 GB/s).
- ``PyeclibBackend`` is the graceful fallback when the shared object cannot be found or fails its
  self-test: pyeclib's ``isa_l_rs_cauchy`` backend, which uses the same Cauchy matrix, so the two
  backends produce identical parity and either one decodes shards the other wrote.

A backend works on raw fragments; headers, checksums and shard selection live in ``codec.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path
from typing import Protocol

import numpy as np

from kvstore.ec import gf256
from kvstore.errors import ConfigError, ECError

BACKENDS = ("auto", "isal", "pyeclib")

_PTR = ctypes.sizeof(ctypes.c_void_p)


class Backend(Protocol):
    """Reed-Solomon over fragments of equal length, matrix ``gf256.cauchy_matrix(k, m)``."""

    name: str

    def encode(
        self, stripe: np.ndarray, offset: int, fragment_len: int, address: int | None = None
    ) -> None:
        """Fill the parity rows of ``stripe`` from its data rows.

        ``stripe`` is a writable C-contiguous (k+m, row_len) uint8 array; row i's fragment is
        ``stripe[i, offset:offset + fragment_len]``; ``address`` is that of ``stripe`` if the
        caller knows it already.
        """
        ...

    def rebuild(
        self, sources: tuple[int, ...], wanted: tuple[int, ...], work: bytearray, fragment_len: int
    ) -> None:
        """Rebuild fragments ``wanted`` from the k fragments of shards ``sources``.

        ``work`` holds len(sources) + len(wanted) rows of ``fragment_len`` bytes back to back:
        the source fragments in the order of ``sources``, then the rows to fill, in the order of
        ``wanted``.
        """
        ...


def find_isal_library() -> str | None:
    """Path of the ISA-L shared object that ``pip install pyeclib`` brought, else a system one."""
    spec = importlib.util.find_spec("pyeclib")
    if spec is not None and spec.origin is not None:
        # auditwheel puts vendored libraries in "<package>.libs" next to the package.
        libs = Path(spec.origin).parent.parent / "pyeclib.libs"
        found = sorted(libs.glob("libisal*.so*"))
        if found:
            return str(found[0])
    return ctypes.util.find_library("isal")


class IsalBackend:
    """ISA-L's ``ec_encode_data`` through ctypes, on fragments in place (no extra copies)."""

    name = "isal"

    def __init__(self, k: int, m: int, library: str) -> None:
        self.k = k
        self.m = m
        self._library = library
        lib = ctypes.CDLL(library)
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        self._init_tables = lib.ec_init_tables
        self._init_tables.argtypes = [c_int, c_int, c_void_p, c_void_p]
        self._init_tables.restype = None
        # No argtypes on the hot call (they cost ~1 us of conversions per call): every argument
        # is a small int (C int), a bytes pointer table or a ctypes array (both pass as pointers).
        self._encode_data = lib.ec_encode_data
        self._encode_data.restype = None
        self.matrix = gf256.cauchy_matrix(k, m)
        self.encode_tables = self.tables(self.matrix[k:])
        self._self_test()

    def tables(self, coefficients: np.ndarray) -> ctypes.Array[ctypes.c_ubyte]:
        """ISA-L's expanded multiplication tables for rows of coefficients (rows x k)."""
        rows = coefficients.shape[0]
        coeffs = (ctypes.c_ubyte * coefficients.size).from_buffer_copy(
            np.ascontiguousarray(coefficients, dtype=np.uint8).tobytes()
        )
        tables = (ctypes.c_ubyte * (32 * self.k * rows))()
        self._init_tables(self.k, rows, coeffs, tables)
        return tables

    def _self_test(self) -> None:
        # A library that is not the ISA-L we expect (another version's conventions, a broken
        # build) must not write parity nobody can decode: compare with the field math once.
        rng = np.random.default_rng(20261111)
        fragment_len = 128
        stripe = np.zeros((self.k + self.m, fragment_len), dtype=np.uint8)
        stripe[: self.k] = rng.integers(0, 256, (self.k, fragment_len), dtype=np.uint8)
        self.encode(stripe, 0, fragment_len)
        expected = gf256.matmul(self.matrix[self.k :], stripe[: self.k])
        if not np.array_equal(stripe[self.k :], expected):
            raise ECError(f"ISA-L at {self._library} disagrees with GF(2^8) Cauchy parity")

    def encode(
        self, stripe: np.ndarray, offset: int, fragment_len: int, address: int | None = None
    ) -> None:
        k, m = self.k, self.m
        row_len = stripe.shape[1]
        if address is None:
            address = ctypes.addressof(ctypes.c_char.from_buffer(stripe.data))
        base = address + offset
        pointers = pointer_table(base, k + m, row_len)
        self._encode_data(fragment_len, k, m, self.encode_tables, pointers, pointers[k * _PTR :])

    def run(
        self,
        tables: ctypes.Array[ctypes.c_ubyte],
        outputs: int,
        fragment_len: int,
        sources: bytes,
        targets: bytes,
    ) -> None:
        """``outputs`` fragments at the ``targets`` pointers from the k at ``sources``, with
        tables from ``decode_tables`` (the codec caches them per loss pattern)."""
        self._encode_data(fragment_len, self.k, outputs, tables, sources, targets)

    def decode_tables(
        self, sources: tuple[int, ...], wanted: tuple[int, ...]
    ) -> ctypes.Array[ctypes.c_ubyte]:
        """Tables that turn the fragments of ``sources`` into those of ``wanted``.

        With B the rows of the encode matrix for the sources, B^-1 maps source fragments back to
        the data fragments; a wanted parity row r is then matrix[r] . B^-1.
        """
        inverse = gf256.invert(self.matrix[list(sources)])
        coefficients = gf256.matmul(self.matrix[list(wanted)], inverse)
        return self.tables(coefficients)

    def rebuild(
        self, sources: tuple[int, ...], wanted: tuple[int, ...], work: bytearray, fragment_len: int
    ) -> None:
        k = self.k
        base = ctypes.addressof(ctypes.c_char.from_buffer(work))
        pointers = pointer_table(base, k + len(wanted), fragment_len)
        tables = self.decode_tables(sources, wanted)
        self.run(tables, len(wanted), fragment_len, pointers, pointers[k * _PTR :])


def pointer_table(base: int, count: int, stride: int) -> bytes:
    """A C array of ``count`` pointers base, base + stride, ... (as bytes: ctypes passes a bytes
    object as a pointer to its data, and this is 2-3x faster than building a ctypes array)."""
    return np.arange(base, base + count * stride, stride, dtype=np.uintp).tobytes()


class PyeclibBackend:
    """pyeclib's ``isa_l_rs_cauchy``: slower (its own headers and copies), same bytes."""

    name = "pyeclib"

    def __init__(self, k: int, m: int) -> None:
        from pyeclib.ec_iface import ECDriver  # imported here: only the fallback needs it

        self.k = k
        self.m = m
        self._driver = ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy")

    def _fragments(self, data: bytes, fragment_len: int) -> tuple[list[bytes], int]:
        fragments = self._driver.encode(data)
        header_len = len(fragments[0]) - fragment_len
        if header_len <= 0 or any(len(f) != header_len + fragment_len for f in fragments):
            raise ECError(
                f"pyeclib returned fragments of {len(fragments[0])} bytes for a fragment length "
                f"of {fragment_len}"
            )
        return fragments, header_len

    def encode(
        self, stripe: np.ndarray, offset: int, fragment_len: int, address: int | None = None
    ) -> None:
        k = self.k
        data = stripe[:k, offset : offset + fragment_len].tobytes()
        fragments, header_len = self._fragments(data, fragment_len)
        for row in range(k, k + self.m):
            stripe[row, offset : offset + fragment_len] = np.frombuffer(
                fragments[row], dtype=np.uint8, count=fragment_len, offset=header_len
            )

    def rebuild(
        self, sources: tuple[int, ...], wanted: tuple[int, ...], work: bytearray, fragment_len: int
    ) -> None:
        k = self.k
        # liberasurecode wants its own fragment headers. With no checksum configured they do not
        # depend on the data, so the headers of an all-zero stripe of this size fit our bytes.
        templates, header_len = self._fragments(bytes(k * fragment_len), fragment_len)
        view = memoryview(work)
        fragments = [
            templates[source][:header_len] + view[row * fragment_len : (row + 1) * fragment_len]
            for row, source in enumerate(sources)
        ]
        rebuilt = self._driver.reconstruct(fragments, list(wanted))
        by_index = {int.from_bytes(f[:4], "little"): f for f in rebuilt}
        for row, index in enumerate(wanted, start=len(sources)):
            fragment = by_index.get(index)
            if fragment is None or len(fragment) != header_len + fragment_len:
                raise ECError(f"pyeclib did not rebuild shard {index}")
            view[row * fragment_len : (row + 1) * fragment_len] = fragment[header_len:]


def load_backend(k: int, m: int, name: str = "auto") -> IsalBackend | PyeclibBackend:
    """The fastest available backend (``auto``), or the one named; ConfigError if unavailable."""
    if name not in BACKENDS:
        raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {name!r}")
    problems: list[str] = []
    if name in ("auto", "isal"):
        library = find_isal_library()
        if library is None:
            problems.append("isal: no libisal shared object (pyeclib.libs/ or system)")
        else:
            try:
                return IsalBackend(k, m, library)
            except (OSError, AttributeError, ECError) as error:
                problems.append(f"isal: {library}: {error}")
    if name in ("auto", "pyeclib"):
        try:
            return PyeclibBackend(k, m)
        except Exception as error:  # ImportError, or pyeclib's ECBackendNotAvailable & co.
            problems.append(f"pyeclib: {type(error).__name__}: {error}")
    raise ConfigError("backend", f"no erasure-coding backend available ({'; '.join(problems)})")
