"""``FeatureStore``'s stored partitions (a mixin of ``fedfeat.store.featurestore.FeatureStore``): a partition's
``order`` / ``offsets`` arrays with their checksums and parameters under ``partitions/<key>``, checked against
their split when read (``fedfeat.partition.stored`` makes ``Partition``s of them)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.store.checks import partition_problems as _partition_problems
from fedfeat.store.checksums import crc
from fedfeat.store.urls import url_filesystem


class StorePartitions:
    """``FeatureStore``'s partitions (the store's ``_g``, ``_read``, ``_arr`` ... are the class's)."""

    # ------------------------------------------------------------------ partitions
    def save_partition_arrays(
        self,
        key: str,
        scheme: str,
        params: dict,
        order: np.ndarray,
        offsets: np.ndarray,
        split: str = "train",
    ) -> str:
        """Store a partition of ``split`` under ``partitions/<key>``: ``order  # [n]`` split rows, client-major;
        ``offsets  # [clients + 1]``; its scheme and parameters (``fedfeat.partition.stored`` makes them)."""
        self._check_split(split)
        # probe first: on a read-only store zarr's concurrent writes fail in background tasks that print their
        # own tracebacks ("Task exception was never retrieved") beside the caller's one-line error
        if isinstance(self.path, Path):
            probe = self.path / f".write-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        else:
            fs, p = url_filesystem(self.path)
            fs.pipe_file(f"{p}/.write-probe-{os.getpid()}", b"")
            fs.rm_file(f"{p}/.write-probe-{os.getpid()}")
        pg = self._g.require_group("partitions")
        if key in pg:
            del pg[key]
        kg = pg.require_group(key)
        kg.create_array("order", shape=order.shape, chunks=(max(len(order), 1),), dtype="int64", fill_value=0)
        kg["order"][:] = order
        kg.create_array("offsets", shape=offsets.shape, chunks=(len(offsets),), dtype="int64", fill_value=0)
        kg["offsets"][:] = offsets
        kg.attrs.update(
            {
                "scheme": scheme,
                "params": params,
                "split": split,
                "crc": {"order": crc(order.astype(np.int64)), "offsets": crc(offsets.astype(np.int64))},
                "complete": True,
            }
        )
        return key

    def partition_keys(self) -> list[str]:
        if "partitions" not in self._g:
            return []
        pg = self._arr("partitions")
        return sorted(k for k, sub in pg.groups() if sub.attrs.get("complete"))

    def _partition_array(self, key: str, name: str, attrs: dict) -> np.ndarray:
        a = self._read(f"partitions/{key}/{name}").astype(np.int64)
        want = attrs.get("crc", {}).get(name)
        if want is not None and crc(a) != want:
            raise FedfeatError(
                f"store {self.path}: partitions/{key}/{name} does not match its checksum (chunk file missing "
                "or changed); make the partition again with `fedfeat partition` (it is recomputed exactly)"
            )
        return a

    def partition_info(self, key: str) -> dict:
        a = dict(self._arr(f"partitions/{key}").attrs)
        offs = self._partition_array(key, "offsets", a)
        return {**a, "clients": len(offs) - 1, "samples": int(offs[-1])}

    def partition_arrays(self, key: str) -> tuple[str, dict, np.ndarray, np.ndarray]:
        """The stored partition ``key`` as ``(scheme, params, order, offsets)`` (``fedfeat.partition.stored.read``
        makes a ``Partition`` of them)."""
        if key not in self.partition_keys():
            known = ", ".join(self.partition_keys()) or "none"
            raise FedfeatError(
                f"store {self.path} has no partition '{key}' (stored: {known}); "
                "create it with `fedfeat partition`"
            )
        a = dict(self._arr(f"partitions/{key}").attrs)
        order, offsets = (self._partition_array(key, k, a) for k in ("order", "offsets"))
        bad = _partition_problems(self, key, a, order, offsets)
        if bad:
            raise FedfeatError(
                f"store {self.path}: {bad[0]}; make the partition again with `fedfeat partition` (it is "
                "recomputed exactly)"
            )
        return a["scheme"], a["params"], order, offsets
