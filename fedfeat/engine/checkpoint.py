"""Checkpoints of a run: everything that persists across rounds, in one atomic safetensors file, checked before
it is trusted.

A checkpoint holds the round counter, the global parameters and the method's persistent state (``ctx.state``:
soft labels, server momentum, federated features, re-trained heads, ...). Random streams are counter-based
(``fedfeat.engine.rng``: a function of seed, round, epoch and sample), so nothing else is needed for a resumed run to
equal an uninterrupted one exactly. Scratch memory (``round_buffers``) is left out. Every key of ``ctx.state`` is
declared (``Method.state_keys``, the engine's ``engine.context.ENGINE_STATE_KEYS``); a resumed run writes the loaded
state back into the method's ``ctx.state`` through that check.

``ctx.state`` is a tree of dicts, lists, tensors and plain values; tensors go into the safetensors file under
their path (``state/agg/gW``), the tree's shape and plain values into its JSON metadata. Loading uses
safetensors (no pickle: a checkpoint cannot execute code).

What ties a checkpoint (format ``fedfeat-checkpoint-2``) to its run, in its metadata:

* ``fedfeat_digest``: the sha256 of the whole file as written with this value zeroed -- every byte, the 8-byte
  header length, the JSON header (metadata, tensor names, dtypes, shapes, offsets) and the tensors' bytes; a
  flipped, missing or added byte anywhere fails ``verify``;
* ``run`` and ``run_digest``: the run's identity (``fedfeat.runs.train``: the resolved settings and method
  hyperparameters, the store's fingerprint, the partition key; not the output paths or the device) and its sha256;
  ``load(..., run=)`` refuses another run's checkpoint, naming the keys that differ;
* ``rows`` and ``rows_n``: the sha256 and count of the ``metrics.jsonl`` rows written up to the checkpoint's round
  (``check_rows``: missing, extra or altered rows before it are refused);
* ``fedfeat``: the version that wrote it (a checkpoint of another version is refused: its state may differ).

Checkpoints of the previous format (``fedfeat-checkpoint-1``: no digest, no identity) cannot be checked and are
refused, with the way to start the run afresh.

Example::

    >>> save("ck.safetensors", 4, {"W": torch.zeros(2, 3)}, {"q": torch.ones(5, 2), "v": None})
    >>> rnd, glob, state = load("ck.safetensors", "cpu")
    >>> rnd, glob["W"].shape, state["v"]
    (4, torch.Size([2, 3]), None)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import torch

from fedfeat._version import __version__
from fedfeat.errors import FedfeatError

FORMAT = "fedfeat-checkpoint-2"
OLD_FORMATS = ("fedfeat-checkpoint-1",)  # no digest, no run identity: refused
TRANSIENT = ("round_buffers",)  # scratch memory of the fused kernels: no state
DIGEST = "fedfeat_digest"
_ZERO = "0" * 64
_HEX = re.compile(r"^[0-9a-f]{64}$")
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header
AFRESH = "start the run afresh without --resume (pass --overwrite to replace the unfinished run)"


def _pack(obj, path: str, tensors: dict):
    """The JSON skeleton of ``obj``; its tensors are put in ``tensors`` under their path."""
    if isinstance(obj, torch.Tensor):
        seen = tensors.setdefault("__seen__", {})  # one tensor held in two places is stored once
        if id(obj) not in seen:
            seen[id(obj)] = path
            tensors[path] = obj.detach().cpu().contiguous()
        return {"__tensor__": seen[id(obj)]}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"checkpoint: non-string key in {path}")
        return {"__dict__": {k: _pack(v, f"{path}/{k}", tensors) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_pack(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store {type(obj).__name__} at {path}")


def _unpack(obj, tensors: dict, device):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]].to(device)
        if "__dict__" in obj:
            return {k: _unpack(v, tensors, device) for k, v in obj["__dict__"].items()}
        if "__list__" in obj:
            return [_unpack(v, tensors, device) for v in obj["__list__"]]
    return obj


def sha256_json(obj) -> str:
    """The sha256 of ``obj`` as canonical JSON (sorted keys, tuples as lists)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def rows_text(rows: list[dict]) -> str:
    """``metrics.jsonl``'s text of ``rows`` (one JSON object a line, as ``fedfeat train`` writes them)."""
    return "".join(json.dumps(r) + "\n" for r in rows)


def save(
    path: str | Path,
    rnd: int,
    glob: dict,
    state: dict,
    extra: dict | None = None,
    *,
    run: dict | None = None,
    rows: str | None = None,
) -> None:
    """Write a checkpoint atomically: a temporary file, its digest filled in, fsync, rename (a kill leaves the
    previous one). ``run``: the run's identity; ``rows``: the ``metrics.jsonl`` text up to round ``rnd``."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict = {}
    skeleton = {
        "glob": _pack(glob, "glob", tensors),
        "state": _pack({k: v for k, v in state.items() if k not in TRANSIENT}, "state", tensors),
    }
    tensors.pop("__seen__", None)
    meta = {**(extra or {}), "format": FORMAT, "round": str(int(rnd)), "tree": json.dumps(skeleton)}
    meta["fedfeat"] = __version__
    if run is not None:
        meta["run"] = json.dumps(run, sort_keys=True, default=str)
        meta["run_digest"] = sha256_json(run)
    if rows is not None:
        meta["rows"] = hashlib.sha256(rows.encode()).hexdigest()
        meta["rows_n"] = str(rows.count("\n"))
    meta[DIGEST] = _ZERO
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "r+b") as f:
            h, pos = _hash_file(f, tmp)
            f.seek(pos)
            f.write(h.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _hash_file(f, path) -> tuple[str, int]:
    """``(sha256 of the whole file with its digest value zeroed, the file offset of that value)`` of the open
    checkpoint ``f`` (read from offset 0)."""
    n, header, meta = _read_header(f, path)
    value = meta.get(DIGEST)
    if not isinstance(value, str) or not _HEX.match(value):
        raise FedfeatError(f"checkpoint {path} carries no valid digest (damaged or not written by fedfeat)")
    field = f'"{DIGEST}":"{value}"'.encode()
    if header.count(field) != 1:
        raise FedfeatError(f"checkpoint {path} has a damaged header (its digest cannot be located)")
    at = header.index(field) + len(field) - 65
    h = hashlib.sha256(n.to_bytes(8, "little"))
    h.update(header[:at] + _ZERO.encode() + header[at + 64 :])
    while chunk := f.read(1 << 22):
        h.update(chunk)
    return h.hexdigest(), 8 + at


def _read_header(f, path) -> tuple[int, bytes, dict]:
    """``(header length, header bytes, metadata)`` of a safetensors file open at offset 0."""
    head = f.read(8)
    if len(head) < 8:
        raise FedfeatError(f"checkpoint {path} is truncated or not a safetensors file ({len(head)} bytes)")
    n = int.from_bytes(head, "little")
    size = os.fstat(f.fileno()).st_size
    if n > MAX_HEADER or 8 + n > size:
        raise FedfeatError(f"checkpoint {path} is truncated or not a safetensors file (header of {n} bytes)")
    header = f.read(n)
    try:
        doc = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FedfeatError(
            f"checkpoint {path} is damaged or not a safetensors file (unreadable header)"
        ) from None
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FedfeatError(f"{path} is not a fedfeat checkpoint (no fedfeat metadata)")
    return n, header, meta


def _open_regular(path: Path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FedfeatError(f"checkpoint {path} is missing") from None
    except OSError as e:
        raise FedfeatError(f"checkpoint {path} is unreadable ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise FedfeatError(f"checkpoint {path} is not a regular file")
    try:
        f = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    except OSError as e:
        raise FedfeatError(f"checkpoint {path} is unreadable ({e.strerror or e})") from None
    return f


def read_meta(path: str | Path) -> dict:
    """The checkpoint's metadata (``round``, ``format`` and what the run added) without loading tensors or checking
    the digest (for listings; ``verify`` checks). A checkpoint of the previous format is read too."""
    path = Path(path)
    with _open_regular(path) as f:
        try:
            _, _, meta = _read_header(f, path)
        except OSError as e:
            raise FedfeatError(f"checkpoint {path} is unreadable ({e.strerror or e})") from None
    if meta.get("format") not in (FORMAT, *OLD_FORMATS):
        raise FedfeatError(f"{path} is not a fedfeat checkpoint")
    return meta


def verify(path: str | Path, afresh: str = AFRESH) -> dict:
    """The checkpoint's metadata once its digest is checked: a ``FedfeatError`` (one line, ending with ``afresh``:
    how to start again) for a file that is truncated, damaged, of the previous format, of another version, not
    a safetensors file, or whose bytes do not match its digest."""
    path = Path(path)
    try:
        with _open_regular(path) as f:
            _, _, meta = _read_header(f, path)
            fmt = meta.get("format")
            if fmt in OLD_FORMATS:
                raise FedfeatError(
                    f"checkpoint {path} is of the previous format ({fmt}), which carries no digest and no run "
                    "identity and so cannot be checked"
                )
            if fmt != FORMAT:
                raise FedfeatError(f"{path} is not a fedfeat checkpoint (format {fmt!r})")
            f.seek(0)
            got, _ = _hash_file(f, path)
    except FedfeatError as e:
        raise FedfeatError(f"cannot resume: {e}; {afresh}") from None
    except OSError as e:
        raise FedfeatError(
            f"cannot resume: checkpoint {path} is unreadable ({e.strerror or e}); {afresh}"
        ) from None
    if got != meta[DIGEST]:
        raise FedfeatError(
            f"cannot resume: checkpoint {path} does not match its digest (changed or damaged after it was written); "
            f"{afresh}"
        )
    if meta.get("fedfeat") != __version__:
        raise FedfeatError(
            f"cannot resume: checkpoint {path} was written by fedfeat {meta.get('fedfeat', '?')}, this is "
            f"{__version__} (its state may differ); {afresh}"
        )
    return meta


def check_run(meta: dict, run: dict, path, afresh: str = AFRESH) -> None:
    """Refuse a checkpoint whose run identity is not ``run``, naming the keys that differ."""
    if meta.get("run_digest") == sha256_json(run):
        return
    try:
        theirs = json.loads(meta.get("run", "null"))
    except ValueError:
        theirs = None
    ours = json.loads(json.dumps(run, sort_keys=True, default=str))
    diffs = _diff(theirs, ours) if isinstance(theirs, dict) else ["its run identity is missing"]
    shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    raise FedfeatError(
        f"cannot resume: checkpoint {path} belongs to another run ({shown or 'its run digest differs'}); {afresh}"
    )


def _diff(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(k), ours.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(
                f"{prefix}{k} {json.dumps(a)[:40]} in the checkpoint, {json.dumps(b)[:40]} in this run"
            )
    return out


def check_round(meta: dict, rounds: int, path, afresh: str = AFRESH) -> int:
    """The checkpoint's round, refused unless 1 <= round < ``rounds`` (a checkpoint is never written after the
    last round)."""
    raw = meta.get("round", "")
    if not re.fullmatch(r"[0-9]{1,9}", raw) or not 1 <= int(raw) < rounds:
        raise FedfeatError(
            f"cannot resume: checkpoint {path} is of round {raw!r}, outside this run's rounds 1..{rounds - 1}; "
            f"{afresh}"
        )
    return int(raw)


def check_rows(meta: dict, rows: list[dict], path, afresh: str = AFRESH) -> list[dict]:
    """The rows of ``metrics.jsonl`` (``rows``) up to the checkpoint's round, refused unless they are rounds
    0..round, once each, in order, and are the rows the checkpoint was written after. Later rows are redone."""
    done = int(meta["round"])
    kept = [r for r in rows if type(r.get("round")) is int and r["round"] <= done]
    got = [r["round"] for r in kept]
    metrics = Path(path).parent / "metrics.jsonl"
    if got != list(range(done + 1)):
        missing = sorted(set(range(done + 1)) - set(got))
        what = (
            f"lacks the rows of rounds {_ranges(missing)}"
            if missing
            else f"holds {len(got) - len(set(got))} repeated row(s)"
            if len(got) != len(set(got))
            else "holds its rows out of order"
        )
        raise FedfeatError(f"cannot resume: {metrics} {what} before the checkpoint's round {done}; {afresh}")
    if meta.get("rows") != hashlib.sha256(rows_text(kept).encode()).hexdigest():
        raise FedfeatError(
            f"cannot resume: {metrics}'s rows of rounds 0..{done} are not those the checkpoint {path} was written "
            f"after (edited or damaged); {afresh}"
        )
    return kept


def _ranges(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:6])) + (f" and {len(xs) - 6} more" if len(xs) > 6 else "")


def load(
    path: str | Path,
    device,
    *,
    run: dict | None = None,
    rounds: int | None = None,
    rows: list[dict] | None = None,
    afresh: str = AFRESH,
) -> tuple[int, dict, dict]:
    """``(round, glob, state)`` from a checkpoint written by ``save``, once checked: its digest (``verify``), and
    where given its run identity (``run``), its round against the run's ``rounds`` and the metric rows before
    it (``rows``: all of ``metrics.jsonl``'s rows; it is cut to those up to the checkpoint's round). Every refusal
    is one ``FedfeatError`` line ending with ``afresh``."""
    from safetensors.torch import load_file

    meta = verify(path, afresh)
    if run is not None:
        check_run(meta, run, path, afresh)
    rnd = check_round(meta, rounds, path, afresh) if rounds is not None else int(meta["round"])
    if rows is not None:
        rows[:] = check_rows(meta, rows, path, afresh)  # the caller's list becomes the rows kept
    try:
        tensors = load_file(str(path))
        tree = json.loads(meta["tree"])
        return rnd, _unpack(tree["glob"], tensors, device), _unpack(tree["state"], tensors, device)
    except Exception as e:  # a file that matches its digest but was not written by save (crafted)
        raise FedfeatError(
            f"cannot resume: checkpoint {path} is not loadable ({type(e).__name__}: {' '.join(str(e).split())[:80]}); "
            f"{afresh}"
        ) from None
