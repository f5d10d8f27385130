"""The device feed (``fedfeat encode --feed device``): open_clip's eval transform on a batch of uint8 images on the
torch device, bit-for-bit equal to the PIL path where the decode is PIL's.

open_clip's eval transform is ``Resize(S, bicubic)`` (shortest side to ``S``, torchvision's size arithmetic), a
centre crop, ``ToTensor`` (``/ 255``) and ``Normalize``; torchvision runs the resize through Pillow. This module
reproduces Pillow's resampler (``src/libImaging/Resample.c``, Pillow 9 to 13) exactly, with integers:

- ``precompute_coeffs``: per output pixel ``xx``, ``center = (xx + 0.5) * scale``, a support of ``2 * max(scale,
  1)`` (the bicubic filter, ``a = -0.5``, widened by the downscale factor), taps ``xmin = (int)(center - support +
  0.5)`` clamped at 0 to ``xmax = (int)(center + support + 0.5)`` clamped at the input size, weights
  ``filter((x + xmin - center + 0.5) / filterscale)`` divided by their sum -- all in doubles, in Pillow's order;
- ``normalize_coeffs_8bpc``: ``(int)(w * 2**22 +- 0.5)`` (``PRECISION_BITS = 32 - 8 - 2``; negative weights round
  away from zero);
- each pass: ``(2**21 + sum(pixel * weight)) >> 22`` clamped to 0..255 (``clip8``), uint8 between the passes;
  horizontal first, then vertical -- except that Pillow 13 goes vertically first when the height shrinks by more
  than twice as many pixels as the width (``vertical_first``); a pass whose size does not change is skipped.

Here a pass is ``K`` gathers along one axis (``K`` = Pillow's ``ksize`` taps) with int32 multiply-adds: exact on any
device (the accumulator stays below 2**31, as Pillow's ``int`` does); past ``DENSE_TAPS`` taps (large downscales) it
is one float64 matmul with the same integer weights (every partial sum an integer below 2**53: exact too). Only the rows and columns the centre crop
keeps are computed. ``tests/test_feed.py`` checks the resize and the whole transform against PIL / open_clip bit for
bit (up- and downscaling, odd and non-square sizes), and the features of ``encode --feed device`` against ``--feed
pil``.

Decoding: images reach the feed as RGB uint8 decoded by the dataset readers (PIL), so on the CPU the model sees
exactly the PIL path's input. On CUDA, JPEG files of file-based datasets are decoded on the GPU with
``torchvision.io.decode_jpeg`` when torchvision's compiled decoder works there (probed once); that decoder (nvJPEG)
is not bit-equal to libjpeg-turbo, so its pixels can differ by a few levels. Anything it cannot decode falls back to
PIL.

Example::

    >>> feed = DeviceFeed.from_transform(clip.transform, clip.device)      # refuses what it cannot reproduce
    >>> px, errors = feed.pixels([("rgb", torch.zeros(375, 500, 3, dtype=torch.uint8))], [""])
    >>> px.shape, px.dtype                                                 # on clip.device
    (torch.Size([1, 3, 224, 224]), torch.uint8)
    >>> feed.normalize(px).dtype
    torch.float32
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedfeat.errors import FedfeatError

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
FEEDS = ("pil", "device")
JPEG_SUFFIXES = (".jpg", ".jpeg")
DENSE_TAPS = (
    24  # a pass with more taps (a downscale by > ~6x) runs as one float64 matmul instead of a tap loop
)


def _pillow_major() -> int:
    import PIL

    try:
        return int(PIL.__version__.split(".")[0])
    except ValueError:
        return 0


PILLOW_MAJOR = _pillow_major()


# ---------------------------------------------------------------------------------------- Pillow's coefficients
def _bicubic(x: float) -> float:
    a = -0.5  # Resample.c's bicubic_filter, same operations in the same order
    if x < 0.0:
        x = -x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _bilinear(x: float) -> float:
    if x < 0.0:
        x = -x
    if x < 1.0:
        return 1.0 - x
    return 0.0


FILTERS = {"bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}


@lru_cache(maxsize=256)
def pil_taps(in_size: int, out_size: int, filter: str = "bicubic") -> tuple[np.ndarray, np.ndarray]:
    """Pillow's resampling taps for one axis: ``(xmin [out] int64, weights [out, ksize] int32)`` -- output pixel
    ``j`` is ``clip8(2**21 + sum_k in[xmin[j] + k] * weights[j, k])``; weights past Pillow's ``xmax`` are 0."""
    if filter not in FILTERS:
        raise ValueError(f"unknown filter {filter!r}; one of {', '.join(FILTERS)}")
    if in_size < 1 or out_size < 1:
        raise ValueError(f"sizes must be >= 1, got {in_size} -> {out_size}")
    fn, fsupport = FILTERS[filter]
    scale = filterscale = float(in_size) / out_size  # box (0, in_size): (double)(in1 - in0) / outSize
    if filterscale < 1.0:
        filterscale = 1.0
    support = fsupport * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    inv = 1.0 / filterscale
    xmins = np.zeros(out_size, dtype=np.int64)
    kk = np.zeros((out_size, ksize), dtype=np.int32)
    one = float(1 << PRECISION_BITS)
    for xx in range(out_size):
        center = 0.0 + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)  # C's (int) truncates toward zero, like int()
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ws, ww = [], 0.0
        for x in range(xmax):
            w = fn((x + xmin - center + 0.5) * inv)
            ws.append(w)
            ww += w
        if ww != 0.0:
            ws = [w / ww for w in ws]
        for x, w in enumerate(ws):  # normalize_coeffs_8bpc
            kk[xx, x] = int(-0.5 + w * one) if w < 0 else int(0.5 + w * one)
        xmins[xx] = xmin
    kk.setflags(write=False)
    xmins.setflags(write=False)
    return xmins, kk


def pil_resize_weights(in_size: int, out_size: int, filter: str = "bicubic") -> np.ndarray:
    """The ``[out_size, in_size]`` int64 matrix of Pillow's fixed-point coefficients (``2**22`` = 1.0) for resizing
    one axis from ``in_size`` to ``out_size``: ``out = clip8((2**21 + M @ in) >> 22)``."""
    xmin, kk = pil_taps(in_size, out_size, filter)
    m = np.zeros((out_size, in_size), dtype=np.int64)
    for j in range(out_size):
        n = min(kk.shape[1], in_size - int(xmin[j]))
        m[j, xmin[j] : xmin[j] + n] = kk[j, :n]
    return m


# ---------------------------------------------------------------------------------------- the exact resize
@lru_cache(maxsize=256)
def _device_taps(in_size, out_size, filter, start, stop, device):
    xmin, kk = pil_taps(in_size, out_size, filter)
    xmin, kk = xmin[start:stop], kk[start:stop]
    keep = int(np.flatnonzero(kk.any(axis=0)).max()) + 1 if kk.any() else 1  # drop all-zero trailing taps
    idx = np.minimum(xmin[:, None] + np.arange(keep)[None, :], in_size - 1)  # [n, K]; the weight there is 0
    return (
        torch.from_numpy(np.ascontiguousarray(idx.T)).to(device),  # [K, n] int64
        torch.from_numpy(np.ascontiguousarray(kk[:, :keep].T)).to(device),  # [K, n] int32
    )


@lru_cache(maxsize=64)
def _dense(in_size, out_size, filter, start, stop, device):
    return torch.from_numpy(pil_resize_weights(in_size, out_size, filter)[start:stop]).to(
        device, torch.float64
    )


def _pass(x: torch.Tensor, dim: int, out_size: int, filter: str, window: tuple[int, int]) -> torch.Tensor:
    """One Pillow pass along ``dim`` of uint8 ``x``, keeping output pixels ``window[0]:window[1]`` -> uint8."""
    in_size = x.shape[dim]
    idx, w = _device_taps(in_size, out_size, filter, window[0], window[1], x.device)
    if idx.shape[0] > DENSE_TAPS:  # a large downscale: one float64 matmul (integers below 2**53: exact)
        m = _dense(in_size, out_size, filter, window[0], window[1], x.device)  # [n, in]
        acc = torch.matmul(m, x.movedim(dim, -2).to(torch.float64)).movedim(-2, dim)
        acc = torch.floor((acc + (1 << (PRECISION_BITS - 1))) / (1 << PRECISION_BITS))
        return acc.clamp_(0, 255).to(torch.uint8)
    shape = [1] * x.dim()
    shape[dim] = idx.shape[1]
    if (
        dim == x.dim() - 1
    ):  # gather whole rows (fast copies), not single elements: pass over a transposed view
        y = _pass(x.transpose(-1, -2).contiguous(), x.dim() - 2, out_size, filter, window)
        return y.transpose(-1, -2)
    xi = x.to(torch.int32)
    acc = xi.index_select(dim, idx[0]).mul_(w[0].view(shape)).add_(1 << (PRECISION_BITS - 1))
    for k in range(1, idx.shape[0]):
        acc.add_(xi.index_select(dim, idx[k]).mul_(w[k].view(shape)))
    return acc.bitwise_right_shift_(PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def _resize_chw(
    x: torch.Tensor,
    out_hw: tuple[int, int],
    filter: str = "bicubic",
    crop: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``[..., H, W]`` uint8 -> ``[..., h, w]`` uint8 as Pillow resizes to ``out_hw``; ``crop = (top, left, ch, cw)``
    keeps only that window of the result (computed alone: the same pixels as cropping afterwards)."""
    H, W = x.shape[-2:]
    oh, ow = out_hw
    top, left, ch, cw = crop if crop is not None else (0, 0, oh, ow)
    # Pillow: a pass whose size does not change is skipped (both: a copy); the order is Pillow's
    passes = [(x.dim() - 1, W, ow, left, cw), (x.dim() - 2, H, oh, top, ch)]
    if vertical_first(H, W, oh, ow):
        passes.reverse()
    for dim, n_in, n_out, start, n in passes:
        if n_out != n_in:
            x = _pass(x, dim, n_out, filter, (start, start + n))
            top, left = (0, left) if dim == x.dim() - 2 else (top, 0)
    return x[..., top : top + ch, left : left + cw]


def vertical_first(h: int, w: int, oh: int, ow: int) -> bool:
    """Whether Pillow resizes ``h x w -> oh x ow`` vertically first. Pillow 13 does when the height shrinks by more
    than twice as many pixels as the width (python-pillow/Pillow#9549; measured here on 1,460 random size pairs: the
    other order differs); earlier versions always go horizontally first."""
    return PILLOW_MAJOR >= 13 and oh < h and (h - oh) > 2 * (w - ow)


def shortest_side_size(h: int, w: int, size: int) -> tuple[int, int]:
    """torchvision ``Resize(size)`` (an int): the short side becomes ``size``, the long one ``int(size * long /
    short)`` -> ``(new_h, new_w)``."""
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return new_h, new_w


def center_crop_box(h: int, w: int, ch: int, cw: int) -> tuple[int, int, int, int]:
    """torchvision ``CenterCrop`` offsets (no padding: the crop must fit) -> ``(top, left, ch, cw)``."""
    if ch > h or cw > w:
        raise ValueError(f"crop {ch}x{cw} is larger than the image {h}x{w}")
    return int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0)), ch, cw


def resize_like_pil(images: torch.Tensor, size, filter: str = "bicubic") -> torch.Tensor:
    """Resize a uint8 batch exactly as Pillow's ``Image.resize(..., BICUBIC)`` does, on ``images.device``.

    ``images``: ``[B, 3, H, W]`` or ``[B, H, W, 3]`` uint8 (channels first when dim 1 is 3); the result has the
    same layout. ``size``: ``(height, width)`` of the result, or an int: torchvision ``Resize(int)``'s shortest
    side (the long side ``int(size * long / short)``)."""
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(
            f"expected a [B, 3, H, W] or [B, H, W, 3] uint8 tensor, got {images.dtype} {tuple(images.shape)}"
        )
    last = images.shape[1] != 3 and images.shape[-1] == 3
    x = images.permute(0, 3, 1, 2) if last else images
    out_hw = (
        shortest_side_size(*x.shape[-2:], size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    )
    y = _resize_chw(x, out_hw, filter)
    return y.permute(0, 2, 3, 1).contiguous() if last else y.contiguous()


# ---------------------------------------------------------------------------------------- the model's transform
@dataclass(frozen=True)
class FeedPlan:
    """What the device feed does: resize (``size`` an int = shortest side, or ``(h, w)``), optional centre crop
    ``(ch, cw)``, then ``/ 255`` and ``(x - mean) / std``."""

    size: int | tuple[int, int]
    crop: tuple[int, int] | None
    filter: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def out_hw(self) -> tuple[int, int]:
        if self.crop is not None:
            return self.crop
        assert not isinstance(self.size, int)
        return self.size

    def geometry(self, h: int, w: int) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
        """``((resized h, w), (top, left, ch, cw))`` for an ``h x w`` image."""
        rh, rw = shortest_side_size(h, w, self.size) if isinstance(self.size, int) else self.size
        crop = center_crop_box(rh, rw, *self.crop) if self.crop is not None else (0, 0, rh, rw)
        return (rh, rw), crop


def _refuse(transform, why: str) -> FedfeatError:
    from fedfeat.encoders.openclip import transform_description

    desc = " ".join(transform_description(transform).split())
    return FedfeatError(
        f"--feed device cannot reproduce this model's eval transform ({why}; it is {desc}); use --feed pil"
    )


def plan_from_transform(transform) -> FeedPlan:
    """The ``FeedPlan`` of an open_clip eval transform, or a one-line ``FedfeatError`` (naming ``--feed pil``) when
    it is not ``Resize(bicubic or bilinear) [+ CenterCrop] [+ RGB conversion] + ToTensor + Normalize``."""
    from torchvision.transforms import CenterCrop, InterpolationMode, Normalize, Resize, ToTensor

    ts = list(getattr(transform, "transforms", []) or [])
    if len(ts) < 3 or not isinstance(ts[-2], ToTensor) or not isinstance(ts[-1], Normalize):
        raise _refuse(transform, "it does not end in ToTensor + Normalize")
    geo = [t for t in ts[:-2] if type(t).__name__ not in ("MaybeConvertMode", "_convert_to_rgb")]
    if getattr(ts[-3], "__name__", "") == "_convert_to_rgb":
        geo = ts[:-3]
    if not geo or type(geo[0]) is not Resize:
        raise _refuse(transform, "its first step is not torchvision's Resize")
    rs = geo[0]
    interp = {InterpolationMode.BICUBIC: "bicubic", InterpolationMode.BILINEAR: "bilinear"}.get(
        rs.interpolation
    )
    if interp is None:
        raise _refuse(transform, f"interpolation {rs.interpolation.value}, not bicubic or bilinear")
    if rs.max_size is not None:
        raise _refuse(transform, "Resize has a max_size")
    size = rs.size
    if isinstance(size, (list, tuple)) and len(size) == 1:
        size = size[0]
    size = int(size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    crop = None
    rest = geo[1:]
    if rest and type(rest[0]) is CenterCrop:
        c = rest[0].size
        crop = (int(c[0]), int(c[1])) if isinstance(c, (list, tuple)) else (int(c), int(c))
        rest = rest[1:]
        room = (size, size) if isinstance(size, int) else size  # a shortest-side resize: both sides >= size
        if crop[0] > room[0] or crop[1] > room[1]:
            raise _refuse(transform, "the centre crop is larger than the resized image (padding)")
    if rest:
        raise _refuse(transform, f"it has a {type(rest[0]).__name__} step")
    if isinstance(size, int) and crop is None:
        raise _refuse(
            transform, "a shortest-side resize without a centre crop gives images of differing sizes"
        )
    nm = ts[-1]
    return FeedPlan(size, crop, interp, tuple(float(v) for v in nm.mean), tuple(float(v) for v in nm.std))


# ---------------------------------------------------------------------------------------- the feed
_TINY_JPEG: bytes | None = None


def _tiny_jpeg() -> bytes:
    global _TINY_JPEG
    if _TINY_JPEG is None:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (120, 30, 200)).save(buf, format="JPEG")
        _TINY_JPEG = buf.getvalue()
    return _TINY_JPEG


def gpu_jpeg_works(device: torch.device) -> bool:
    """Whether ``torchvision.io.decode_jpeg`` decodes on ``device`` (CUDA with torchvision's compiled decoder)."""
    if device.type != "cuda":
        return False
    try:
        from fedfeat.encoders.remedy import apply_torchvision_remedy

        apply_torchvision_remedy()
        from torchvision.io import ImageReadMode, decode_jpeg

        data = torch.frombuffer(bytearray(_tiny_jpeg()), dtype=torch.uint8)
        out = decode_jpeg([data], mode=ImageReadMode.RGB, device=device)
        return tuple(out[0].shape) == (3, 16, 16)
    except Exception:  # no compiled torchvision, no nvJPEG: PIL decodes
        return False


def _pil_decode(data: torch.Tensor) -> torch.Tensor:
    """JPEG bytes -> ``[H, W, 3]`` uint8 with PIL (as the readers decode); raises what PIL raises."""
    from PIL import Image

    with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
        img.load()
        return torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8))


class DeviceFeed:
    """Raw uint8 images (any sizes) -> the model's input on ``device``: the exact Pillow resize, centre crop, then
    ``ToTensor`` + ``Normalize`` arithmetic.

    ``pixels(items, errors)`` takes a batch as the loader gives it (``RawRows`` + ``collate_raw``): per image
    ``("rgb", [H, W, 3] uint8)``, ``("jpeg", [N] uint8 file bytes, path)`` or None (unreadable; its error message in
    ``errors``), and returns ``([B, 3, h, w] uint8 on the device, errors)`` (zeros for unreadable images).
    ``normalize`` turns those pixels into the float32 input."""

    def __init__(self, plan: FeedPlan, device: str | torch.device = "cpu"):
        self.plan = plan
        self.device = torch.device(device)
        self.decodes_jpeg = gpu_jpeg_works(self.device)

    @classmethod
    def from_transform(cls, transform, device: str | torch.device = "cpu") -> DeviceFeed:
        return cls(plan_from_transform(transform), device)

    @property
    def mean(self) -> list[float]:
        return list(self.plan.mean)

    @property
    def std(self) -> list[float]:
        return list(self.plan.std)

    def _decode(self, items, errors) -> list:
        """``("jpeg", bytes)`` items -> ``[3, H, W]`` uint8 on the device (GPU decoder, PIL where it fails);
        ``("rgb", [H, W, 3])`` -> ``[3, H, W]`` (still on the CPU)."""
        out: list = [None] * len(items)
        jpegs = [k for k, it in enumerate(items) if it is not None and it[0] == "jpeg"]
        if jpegs and self.decodes_jpeg:
            from torchvision.io import ImageReadMode, decode_jpeg

            try:
                dec = decode_jpeg([items[k][1] for k in jpegs], mode=ImageReadMode.RGB, device=self.device)
                for k, img in zip(jpegs, dec):
                    out[k] = img
            except Exception:  # one image the GPU decoder refuses: decode them one by one
                for k in jpegs:
                    try:
                        out[k] = decode_jpeg(items[k][1], mode=ImageReadMode.RGB, device=self.device)
                    except Exception:
                        pass
        for k, it in enumerate(items):
            if it is None or out[k] is not None:
                continue
            data = it[1]
            if it[0] == "jpeg":
                try:
                    data = _pil_decode(data)
                except Exception as e:  # what the PIL path reports
                    from fedfeat.data.base import UnreadableImage

                    errors[k] = errors[k] or str(UnreadableImage(it[2], f"{type(e).__name__}: {e}"))
                    continue
            out[k] = data.permute(2, 0, 1)
        return out

    def pixels(self, items, errors=None) -> tuple[torch.Tensor, list[str]]:
        errors = list(errors) if errors is not None else [""] * len(items)
        imgs = self._decode(items, errors)
        h, w = self.plan.out_hw
        out = torch.zeros(len(items), 3, h, w, dtype=torch.uint8, device=self.device)
        groups: dict[tuple[int, int], list[int]] = {}
        for k, img in enumerate(imgs):
            if img is not None:
                groups.setdefault(tuple(img.shape[-2:]), []).append(k)
        for (ih, iw), ks in groups.items():
            x = torch.stack([imgs[k] for k in ks]).to(self.device, non_blocking=True)  # [b, 3, H, W] uint8
            out_hw, crop = self.plan.geometry(ih, iw)
            y = _resize_chw(x, out_hw, self.plan.filter, crop)
            out[torch.as_tensor(ks, device=self.device)] = y
        return out, errors

    def normalize(self, px: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, 3, h, w]`` -> float32 ``(px / 255 - mean) / std`` (torchvision's arithmetic)."""
        return normalize_pixels(px.to(self.device), self.plan.mean, self.plan.std)

    def __call__(self, items, errors=None) -> torch.Tensor:
        return self.normalize(self.pixels(items, errors)[0])


def normalize_pixels(px, mean, std):
    """uint8 model inputs ``[B, 3, H, W]`` (a torch tensor, any device) -> the model's float32 input, with exactly
    torchvision's ``ToTensor`` + ``Normalize`` arithmetic (``x / 255``, then ``(x - mean) / std`` per channel)."""
    import torch

    x = px.to(torch.float32).div(255)
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return x.sub_(m).div_(s)


_FEEDS: dict = {}  # (preprocess config, device) -> DeviceFeed


def preprocess_batch(images_uint8: torch.Tensor, preprocess_cfg: dict, device) -> torch.Tensor:
    """One batch of same-sized uint8 images ``[B, 3, H, W]`` -> the model's float32 input ``[B, 3, S, S]`` on
    ``device``, by the eval transform open_clip makes from ``preprocess_cfg`` (``ClipModel.preprocess``): the exact
    Pillow resize, centre crop and normalisation (``make bench-gpu``'s device feed column)."""
    key = (repr(sorted(preprocess_cfg.items())), str(device))
    feed = _FEEDS.get(key)
    if feed is None:
        from fedfeat.encoders.remedy import import_open_clip

        import_open_clip()
        from open_clip.transform import PreprocessCfg, image_transform_v2

        tf = image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=False)
        feed = _FEEDS[key] = DeviceFeed.from_transform(tf, device)
    x = images_uint8.to(feed.device)
    out_hw, crop = feed.plan.geometry(*x.shape[-2:])
    return feed.normalize(_resize_chw(x, out_hw, feed.plan.filter, crop))


# ---------------------------------------------------------------------------------------- the loader's side
class RawRows(torch.utils.data.Dataset):
    """Map-style dataset over ``(split, row)`` keys -> ``(("rgb", [H, W, 3] uint8) | ("jpeg", bytes, path) | None,
    error message)``: decoded by the reader (PIL), or, with ``jpeg``, the bytes of a JPEG file (file-based readers)."""

    def __init__(self, ds, jpeg: bool = False):
        self.ds = ds
        self.jpeg = jpeg and hasattr(ds, "_abs")

    def __getitem__(self, key):
        from fedfeat.data.base import UnreadableImage

        split, i = key
        if self.jpeg:
            path = self.ds._abs(split, i)
            if path.suffix.lower() in JPEG_SUFFIXES:
                try:
                    data = path.read_bytes()
                except OSError:
                    data = b""
                if data[:2] == b"\xff\xd8":  # else: let the reader say what is wrong
                    return ("jpeg", torch.frombuffer(bytearray(data), dtype=torch.uint8), str(path)), ""
        try:
            img = self.ds.load_image(split, i)
        except UnreadableImage as e:
            return None, str(e)
        return ("rgb", torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8))), ""


def collate_raw(items):
    """A batch of ``RawRows`` items -> ``(list of images, list of error messages)`` (sizes differ: no stacking)."""
    return [x for x, _ in items], [e for _, e in items]
